"""What tensor and data parallelism cost and give on this machine.

1. Tensor parallel: the decode step time of a Qwen2.5-0.5B-shaped model (24 layers, hidden 896,
   14 heads / 2 KV heads, random weights, bf16 where the kernels have it) at batch 1 and 16,
   TP=1 on all the cores against TP=2 (one rank process per half of the cores), with the time
   the step spent in paddle.distributed collectives (all-reduce, all-gather, broadcast): the
   all-reduce share of the step.
2. Data parallel: output throughput of ``fastdeploy serve`` (the default SmolLM2) with -dp 1
   and -dp 2 at 16 concurrent streams.

On a machine with few cores TP=2 is slower than TP=1 (two all-reduces per layer, and each
rank has half the cores): this measures the price, it does not promise a speed-up.

    python benchmarks/benchmark_parallel.py --out benchmarks/results/parallel.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

MODEL_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
BLOCK = 16


def _timed_collectives() -> dict[str, float]:
    """Wrap paddle.distributed's collectives so the seconds spent in them add up in the returned dict."""
    import paddle.distributed as dist

    spent = {"all_reduce": 0.0, "all_gather": 0.0, "broadcast": 0.0}
    for name in spent:
        inner = getattr(dist, name)

        def timed(*args, _inner=inner, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(dist, name, timed)
    return spent


def _step(model, caches, tables, rng, n, seq_lens) -> None:
    """One forward of ``n`` new tokens per sequence (``seq_lens`` long after it), LM head on each last row."""
    import numpy as np
    import paddle

    from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata

    meta, positions = build_attention_metadata(tables[:, : -(-int(seq_lens.max()) // BLOCK)], n, seq_lens, BLOCK)
    ids = rng.integers(3, MODEL_CONFIG["vocab_size"], len(positions))
    with paddle.no_grad():
        hidden = model(paddle.to_tensor(ids), paddle.to_tensor(positions), caches, meta)
        model.compute_logits(paddle.gather(hidden, paddle.to_tensor(np.cumsum(n) - 1)))


def _rank(rank: int, world: int, port: int, folder: str, dtype: str, batches: list[int], context: int, steps: int,
          cores: list[int], out: str) -> None:
    os.sched_setaffinity(0, cores)
    import numpy as np
    import paddle

    from fastdeploy.config import LoadConfig, ModelConfig
    from fastdeploy.distributed.parallel_state import DistributedInit, init_distributed_environment
    from fastdeploy.model_executor.model_loader import get_model

    init_distributed_environment(DistributedInit(rank, world, "127.0.0.1", port))
    spent = _timed_collectives()
    model = get_model(ModelConfig(model=folder, dtype=dtype), LoadConfig(load_format="dummy"))
    results = {}
    for batch in batches:
        per_seq = -(-(context + steps + 1) // BLOCK)
        shape = [batch * per_seq, BLOCK, model.num_kv_heads, model.head_dim]
        caches = [(paddle.zeros(shape, model.kv_cache_dtype), paddle.zeros(shape, model.kv_cache_dtype))
                  for _ in range(model.num_layers)]
        tables = np.arange(batch * per_seq, dtype=np.int64).reshape(batch, per_seq)
        rng = np.random.default_rng(0)
        # The prefill of every sequence, then the timed decode steps.
        _step(model, caches, tables, rng, np.full(batch, context), np.full(batch, context))
        times, comm = [], []
        for k in range(steps):
            before = sum(spent.values())
            start = time.perf_counter()
            _step(model, caches, tables, rng, np.ones(batch, dtype=np.int64), np.full(batch, context + k + 1))
            times.append(time.perf_counter() - start)
            comm.append(sum(spent.values()) - before)
        step_ms = statistics.median(times) * 1e3
        comm_ms = statistics.median(comm) * 1e3
        results[batch] = {"step_ms": round(step_ms, 2), "collectives_ms": round(comm_ms, 2),
                          "collectives_share": round(comm_ms / step_ms, 3)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def tensor_parallel(tp: int, folder: str, dtype: str, batches: list[int], context: int, steps: int) -> dict:
    from fastdeploy import envs
    from fastdeploy.executor.multiproc_executor import free_port_pair
    from fastdeploy.platforms.cpu_binding import plan_rank_cores

    cores = plan_rank_cores(tp, oversubscribe=True)
    port = free_port_pair()
    out = tempfile.mktemp(suffix=".json")
    mp = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(tp):
        p = mp.Process(target=_rank, args=(rank, tp, port, folder, dtype, batches, context, steps,
                                           sorted(cores[rank]), out))
        with envs.child_environment({"OMP_NUM_THREADS": str(len(cores[rank]))}):
            p.start()
        procs.append(p)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"TP={tp} ranks exited with {[p.exitcode for p in procs]}")
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return {"tp": tp, "threads_per_rank": len(cores[0]), **{f"batch_{b}": v for b, v in result.items()}}


async def _streams(port: int, streams: int, max_tokens: int) -> float:
    import openai

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0, timeout=600)

    async def one(i: int) -> int:
        r = await client.completions.create(model="default", prompt=f"Story {i}: once upon a time", max_tokens=max_tokens,
                                            temperature=0, extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    await one(-1)  # warm-up
    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
    return tokens / (time.perf_counter() - start)


def data_parallel(dp: int, streams: int, max_tokens: int) -> dict:
    import httpx

    from fastdeploy.executor.multiproc_executor import free_port_pair

    port = free_port_pair()
    env = {**os.environ, "FD_CPU_OVERSUBSCRIBE": "1"}
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--served-model-name", "default",
           "-dp", str(dp), "--max-model-len", "1024", "--kv-cache-memory-bytes", "256M", "--disable-log-stats",
           "--port", str(port), "--uvicorn-log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"-dp {dp} server exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        throughput = asyncio.run(_streams(port, streams, max_tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    return {"dp": dp, "streams": streams, "max_tokens": max_tokens, "output_tokens_per_s": round(throughput, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--skip-dp", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="fd-bench-parallel-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(MODEL_CONFIG, f)
    result = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor() or platform.machine()},
        "tensor_parallel": [tensor_parallel(tp, folder, args.dtype, args.batches, args.context, args.steps)
                            for tp in (1, 2)],
    }
    if not args.skip_dp:
        result["data_parallel"] = [data_parallel(dp, args.streams, args.max_tokens) for dp in (1, 2)]
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
