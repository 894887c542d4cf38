"""The other process of the KV-transfer tests: a prefill side that sends or publishes blocks."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

from fastdeploy.distributed.kv_transfer import PeerAddress, create_kv_connector

NUM_LAYERS, NUM_BLOCKS, BLOCK_SHAPE = 3, 12, (16, 3, 64)  # SmolLM2's block: 16 tokens x 3 KV heads x 64


def make_caches(seed: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (K, V) of shape [NUM_BLOCKS, *BLOCK_SHAPE]: random from ``seed``, or zeros."""
    shape = (NUM_BLOCKS, *BLOCK_SHAPE)
    if seed is None:
        return [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(NUM_LAYERS)]
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32))
            for _ in range(NUM_LAYERS)]


def send(peer: dict, protocol: str, request_id: str, block_ids: list[int], seed: int, layer_wise: bool,
         result: mp.Queue) -> None:
    """Push blocks to ``peer`` (all layers at once, or one message per layer)."""
    with create_kv_connector(make_caches(seed), protocol=protocol, timeout_s=10) as conn:
        address = PeerAddress.from_dict(peer)
        try:
            if layer_wise:
                for layer in range(NUM_LAYERS):
                    last = layer == NUM_LAYERS - 1
                    conn.send_blocks(address, request_id, block_ids, layers=[layer], final=last,
                                     meta={"first_token_id": 42} if last else None)
            else:
                conn.send_blocks(address, request_id, block_ids, meta={"first_token_id": 42})
            result.put(("ok", conn.metrics.total("bytes", "send")))
        except Exception as e:
            result.put(("error", f"{type(e).__name__}: {e}"))


def publish(protocol: str, request_id: str, block_ids: list[int], seed: int, ttl_s: float, out: mp.Queue) -> None:
    """Publish blocks, report the address, and stay until they are pulled (or expire)."""
    done: mp.Queue = out
    finished = []
    with create_kv_connector(make_caches(seed), protocol=protocol, timeout_s=10,
                             on_publish_done=lambda rid, ok, err: finished.append((rid, ok, err))) as conn:
        conn.publish(request_id, block_ids, meta={"first_token_id": 7}, ttl_s=ttl_s)
        done.put(conn.address.to_dict())
        deadline = time.monotonic() + ttl_s + 5
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
        done.put(finished[0] if finished else ("timeout", False, None))


def receive_forever(protocol: str, out: mp.Queue) -> None:
    """A receiver that expects a request, reports its address, then waits to be killed."""
    with create_kv_connector(make_caches(None), protocol=protocol, timeout_s=60) as conn:
        conn.expect("doomed", [0, 1, 2])
        out.put(conn.address.to_dict())
        time.sleep(120)


def send_one_layer_then_hang(peer: dict, protocol: str, request_id: str, block_ids: list[int],
                             out: mp.Queue) -> None:
    """Send layer 0 of a request, report, then hang (the test kills this process mid-transfer)."""
    with create_kv_connector(make_caches(11), protocol=protocol, timeout_s=10) as conn:
        conn.send_blocks(PeerAddress.from_dict(peer), request_id, block_ids, layers=[0], final=False)
        out.put("sent")
        time.sleep(120)
