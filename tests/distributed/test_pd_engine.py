"""The engine-side PD glue: both router protocols end to end between two connectors."""

from __future__ import annotations

import time

import numpy as np
import pytest
from kv_peer import make_caches

from fastdeploy.distributed.kv_transfer.pd_engine import PDKVTransfer


def wait_for(fn, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.01)


@pytest.fixture
def pair():
    src, dst = make_caches(21), make_caches(None)
    prefill = PDKVTransfer(src, "127.0.0.1", timeout_s=5)
    decode = PDKVTransfer(dst, "127.0.0.1", timeout_s=5)
    yield prefill, decode, src, dst
    prefill.close()
    decode.close()


def test_sequential_decode_pulls_what_prefill_published(pair):
    prefill, decode, src, dst = pair
    params = prefill.on_prefill_done("req", [4, 2, 7], first_token_id=42, num_tokens=40,
                                     params={"do_remote_decode": True, "transfer_protocol": "shm"})
    assert params["do_remote_prefill"] and params["remote_port"] == prefill.address.port
    assert params["remote_block_ids"] == [4, 2, 7] and params["first_token_id"] == 42
    assert prefill.take_releasable() == []  # held until the decode side pulls
    decode.on_decode_allocated("req", [0, 1, 2], params)
    done, failed = {}, {}
    wait_for(lambda: done.update(decode.take_received()[0]) or done)
    assert done == {"req": {"first_token_id": 42}} and not failed
    for layer in range(len(src)):
        np.testing.assert_array_equal(dst[layer][1][[0, 1, 2]], src[layer][1][[4, 2, 7]])
    assert wait_for(prefill.take_releasable) == [("req", True, None)]


def test_concurrent_prefill_pushes_to_the_decode_instance(pair):
    prefill, decode, src, dst = pair
    address = decode.address
    decode.on_decode_allocated("req", [5, 6], {"mode": "concurrent"})
    prefill.on_prefill_done("req", [1, 3], first_token_id=7,
                            params={"mode": "concurrent", "remote_host": address.host, "remote_port": address.port,
                                    "remote_host_id": address.host_id, "remote_request_id": "req"})
    done = {}
    wait_for(lambda: done.update(decode.take_received()[0]) or done)
    assert done == {"req": {"first_token_id": 7}}
    np.testing.assert_array_equal(dst[0][0][[5, 6]], src[0][0][[1, 3]])
    assert wait_for(prefill.take_releasable) == [("req", True, None)]


def test_decode_gone_frees_the_prefill_blocks(pair):
    prefill, decode, _, _ = pair
    address = decode.address
    decode.close()
    started = time.monotonic()
    prefill.on_prefill_done("req", [1], first_token_id=7,
                            params={"mode": "concurrent", "remote_host": address.host, "remote_port": address.port,
                                    "remote_request_id": "req"})
    [(request_id, delivered, error)] = wait_for(prefill.take_releasable, 15)
    assert (request_id, delivered) == ("req", False) and "is the peer alive" in error
    assert time.monotonic() - started < 10


def test_unpulled_blocks_expire_and_a_failed_pull_is_reported(pair):
    prefill, decode, _, _ = pair
    prefill.connector.publish("stale", [1], ttl_s=0.3)
    assert wait_for(prefill.take_releasable) == [("stale", False, "not pulled before its deadline")]
    # Pulling something the prefill instance never published fails the decode request.
    decode.on_decode_allocated("ghost", [0], {"remote_host": prefill.address.host,
                                              "remote_port": prefill.address.port, "remote_request_id": "ghost"})
    failed = {}
    wait_for(lambda: failed.update(decode.take_received()[1]) or failed)
    assert "not published here" in str(failed["ghost"])
