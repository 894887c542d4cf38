"""Cost of moving one request's KV cache between two processes: TCP (ZMQ) vs shared memory.

The cache has the default model's shape (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64,
blocks of 16 tokens, fp32). A sender process pushes a request's blocks into blocks the
receiver (this process) pre-allocated, as a prefill instance does for a decode instance; the
time is from the send call to the receiver seeing the request complete.

    python benchmarks/benchmark_kv_transfer.py --prompt-lens 128 512 1024 --repeats 10
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time

import numpy as np

from fastdeploy.distributed.kv_transfer import PeerAddress, create_kv_connector

NUM_LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 30, 16, 3, 64


def caches(num_blocks: int, fill: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    make = (lambda: np.random.default_rng(0).standard_normal(shape, np.float32)) if fill else \
        (lambda: np.zeros(shape, np.float32))
    return [(make(), make()) for _ in range(NUM_LAYERS)]


def sender(peer: dict, protocol: str, plan: list[tuple[str, list[int]]], num_blocks: int, ready: mp.Queue,
           go: mp.Queue) -> None:
    with create_kv_connector(caches(num_blocks, True), protocol=protocol, timeout_s=60) as conn:
        address = PeerAddress.from_dict(peer)
        ready.put("ready")
        for request_id, block_ids in plan:
            go.get()
            conn.send_blocks(address, request_id, block_ids)


def measure(protocol: str, prompt_len: int, repeats: int) -> dict:
    blocks_per_request = -(-prompt_len // BLOCK_SIZE)
    num_blocks = 4 * blocks_per_request
    ctx = mp.get_context("spawn")
    ready, go = ctx.Queue(), ctx.Queue()
    with create_kv_connector(caches(num_blocks, False), timeout_s=60) as receiver:
        rng = np.random.default_rng(1)
        plan = [(f"r{i}", sorted(rng.choice(num_blocks, blocks_per_request, replace=False).tolist()))
                for i in range(repeats + 1)]
        proc = ctx.Process(target=sender, args=(receiver.address.to_dict(), protocol, plan, num_blocks, ready, go))
        proc.start()
        ready.get(timeout=120)
        times, nbytes = [], 0
        for i, (request_id, _) in enumerate(plan):
            receiver.expect(request_id, list(range(blocks_per_request)))
            started = time.perf_counter()
            go.put(1)
            result = receiver.wait(request_id, timeout_s=60)
            if i:  # the first transfer warms sockets and segments up
                times.append(time.perf_counter() - started)
                nbytes = result.num_bytes
        proc.join(30)
    median = statistics.median(times)
    return {"protocol": protocol, "prompt_tokens": prompt_len, "blocks": blocks_per_request, "bytes": nbytes,
            "bytes_per_token": nbytes // prompt_len, "median_ms": round(median * 1000, 3),
            "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1000, 3),
            "gbytes_per_s": round(nbytes / median / 1e9, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "kv_transfer.json"))
    args = parser.parse_args()
    rows = []
    for prompt_len in args.prompt_lens:
        for protocol in ("tcp", "shm"):
            row = measure(protocol, prompt_len, args.repeats)
            print(json.dumps(row), flush=True)
            rows.append(row)
    report = {"benchmark": "kv_transfer", "model_shape": {"layers": NUM_LAYERS, "block_size": BLOCK_SIZE,
                                                          "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                          "dtype": "float32"},
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "results": rows}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
