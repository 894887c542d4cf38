"""KV transfer connectors moving real block data between two processes (TCP and shared memory)."""

from __future__ import annotations

import multiprocessing as mp
import time

import kv_peer
import numpy as np
import pytest
from kv_peer import NUM_LAYERS, make_caches
from prometheus_client import CollectorRegistry, generate_latest

from fastdeploy.distributed.kv_transfer import (
    KVTransferError,
    KVTransferMetrics,
    KVTransferTimeout,
    PeerAddress,
    create_kv_connector,
    select_transfer_protocol,
)

CTX = mp.get_context("spawn")
PROTOCOLS = ["tcp", "shm"]


def start(target, *args) -> mp.Process:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def assert_blocks_equal(dst, src, dst_ids, src_ids) -> None:
    for layer in range(NUM_LAYERS):
        for kv in (0, 1):
            np.testing.assert_array_equal(dst[layer][kv][dst_ids], src[layer][kv][src_ids])


@pytest.mark.parametrize("layer_wise", [False, True], ids=["whole", "layer-wise"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_push_into_preallocated_blocks(protocol, layer_wise):
    dst = make_caches(None)
    registry = CollectorRegistry()
    with create_kv_connector(dst, timeout_s=60, metrics=KVTransferMetrics(registry)) as receiver:
        dst_ids, src_ids = [7, 2, 9, 4], [0, 5, 6, 11]
        receiver.expect("req-1", dst_ids)
        result = CTX.Queue()
        proc = start(kv_peer.send, receiver.address.to_dict(), protocol, "req-1", src_ids, 1234, layer_wise, result)
        got = receiver.wait("req-1", timeout_s=60)
        status, sent_bytes = result.get(timeout=30)
        proc.join(30)
    assert status == "ok", sent_bytes
    assert got.protocol == protocol and got.meta == {"first_token_id": 42}
    assert got.num_blocks == 4 and got.num_bytes == sent_bytes == 4 * NUM_LAYERS * 2 * 16 * 3 * 64 * 4
    assert_blocks_equal(dst, make_caches(1234), dst_ids, src_ids)
    # Blocks outside the allocation are untouched.
    assert not dst[0][0][[0, 1, 3]].any()
    text = generate_latest(registry).decode()
    assert f'fastdeploy:kv_transfer_bytes_total{{direction="recv",protocol="{protocol}"}} {float(sent_bytes)}' in text
    assert f'fastdeploy:kv_transfer_blocks_total{{direction="recv",protocol="{protocol}"}} 4.0' in text


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_pull_published_blocks(protocol):
    out = CTX.Queue()
    proc = start(kv_peer.publish, protocol, "prefill-req", [3, 1, 8], 99, 30.0, out)
    peer = PeerAddress.from_dict(out.get(timeout=60))
    dst = make_caches(None)
    with create_kv_connector(dst, protocol=protocol, timeout_s=30) as receiver:
        got = receiver.pull(peer, "decode-req", [0, 1, 2], remote_request_id="prefill-req")
    assert got.meta == {"first_token_id": 7}
    assert_blocks_equal(dst, make_caches(99), [0, 1, 2], [3, 1, 8])
    # The prefill side is told the blocks were delivered, so it frees them.
    assert out.get(timeout=30) == ("prefill-req", True, None)
    proc.join(30)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_sender_killed_mid_transfer_fails_the_receive_in_time(protocol):
    dst = make_caches(None)
    with create_kv_connector(dst, timeout_s=60) as receiver:
        receiver.expect("cut", [0, 1], timeout_s=4)
        out = CTX.Queue()
        proc = start(kv_peer.send_one_layer_then_hang, receiver.address.to_dict(), protocol, "cut", [3, 4], out)
        assert out.get(timeout=60) == "sent"
        proc.kill()
        proc.join(10)
        with pytest.raises(KVTransferTimeout, match=r"not received in time \(2 of 6 block-layers\).*sending instance"):
            receiver.wait("cut")
        assert receiver.metrics.total("failures", "recv") == 1
        # poll() reports expirations too (the engine loop's way, so it can free the blocks).
        receiver.expect("never", [0], timeout_s=0.2)
        time.sleep(0.5)
        finished, failed = receiver.poll()
        assert not finished and isinstance(failed["never"], KVTransferTimeout)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_receiver_killed_fails_the_send_in_time(protocol):
    out = CTX.Queue()
    proc = start(kv_peer.receive_forever, protocol, out)
    peer = PeerAddress.from_dict(out.get(timeout=60))
    with create_kv_connector(make_caches(5), protocol=protocol, timeout_s=3) as sender:
        sender.send_blocks(peer, "doomed", [0, 1, 2], final=False, layers=[0])  # the peer is alive: accepted
        proc.kill()
        proc.join(10)
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="is the peer alive"):
            sender.send_blocks(peer, "doomed", [0, 1, 2], layers=[1, 2])
        assert time.monotonic() - started < 6
        assert sender.metrics.total("failures", "send") == 1


def test_unreachable_peer_and_refusals_are_clear_errors():
    src, dst = make_caches(1), make_caches(None)
    with create_kv_connector(src, timeout_s=1) as sender, create_kv_connector(dst) as receiver:
        with pytest.raises(KVTransferTimeout, match="did not expect request ghost"):
            sender.send_blocks(receiver.address, "ghost", [0])
        receiver.expect("aborted", [0])
        receiver.abort("aborted")
        with pytest.raises(KVTransferError, match="was aborted by the receiver"):
            sender.send_blocks(receiver.address, "aborted", [0])
        receiver.expect("small", [0, 1])
        with pytest.raises(KVTransferError, match=r"Blocks \[0, 3\) exceed the 2 blocks"):
            sender.send_blocks(receiver.address, "small", [0, 1, 2])
        with pytest.raises(KVTransferError, match="exceed the 2 blocks"):
            receiver.wait("small", 1)  # the bad message failed the request on the receiving side too
    other = create_kv_connector([(np.zeros((4, 8, 3, 64), np.float32),) * 2])
    with create_kv_connector(src, timeout_s=1) as sender, other:
        other.expect("mismatch", [0])
        with pytest.raises(KVTransferError, match="block shape"):
            sender.send_blocks(other.address, "mismatch", [0], layers=[0], final=False)


def test_topology_picks_shm_on_one_host_and_tcp_across():
    assert select_transfer_protocol("host-a", "host-a") == "shm"
    assert select_transfer_protocol("host-a", "host-b") == "tcp"
    assert select_transfer_protocol(None, None) == "tcp"
    assert select_transfer_protocol("host-a", "host-a", ["tcp"], ["shm", "tcp"]) == "tcp"
    with pytest.raises(ValueError, match="No common KV transfer protocol"):
        select_transfer_protocol("a", "b", ["shm"], ["shm"])
    src, dst = make_caches(3), make_caches(None)
    with create_kv_connector(src) as sender, create_kv_connector(dst) as receiver:
        assert sender.protocol_for(receiver.address) == "shm"
        # The same receiver, seen as if it were on another machine: TCP.
        remote = PeerAddress(receiver.address.host, receiver.address.port, "another-machine")
        assert sender.protocol_for(remote) == "tcp"
        receiver.expect("r", [1])
        assert sender.send_blocks(remote, "r", [2]).protocol == "tcp"
        assert receiver.wait("r", 5).protocol == "tcp"
        assert_blocks_equal(dst, src, [1], [2])
    with create_kv_connector(src, protocol="ipc") as shm_only:
        with pytest.raises(KVTransferError, match="needs the peer .* on this host"):
            shm_only.protocol_for(PeerAddress("10.0.0.9", 1, "another-machine"))
