"""Prefill/decode pairing over HTTP with fake instances: what each half receives and returns."""

from __future__ import annotations

import json
import time

import pytest

from fastdeploy.distributed.kv_transfer.topology import local_host_id


def pd_router(make_router, fakes, protocol: str, **kwargs):
    router = make_router(pd_protocol=protocol, **kwargs)
    (prefill, p_server), (decode, d_server) = fakes("P", "prefill"), fakes("D", "decode")
    host_id = local_host_id()
    router.register(p_server, role="prefill", connector_port=7001, host_id=host_id,
                    transfer_protocol=["shm", "tcp"])
    router.register(d_server, role="decode", connector_port=7002, host_id=host_id,
                    transfer_protocol=["shm", "tcp"])
    return router, prefill, decode


def events(text: str) -> list[str]:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_sequential_prefill_then_decode(make_router, fakes, stream):
    router, prefill, decode = pd_router(make_router, fakes, "sequential")
    body = {"model": "fake-model", "prompt": "Tell me a story", "max_tokens": 50, "stream": stream,
            "stream_options": {"include_usage": True}, "min_tokens": 5}
    resp = router.client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    if stream:
        texts = [json.loads(e)["choices"][0]["text"] for e in events(resp.text)[:-1]]
        assert texts[0] == "decoded by D from P #0"
    else:
        assert resp.json()["choices"][0]["text"] == "decoded by D from P"
    [p_body], [d_body] = prefill.bodies, decode.bodies
    # The prefill half: one token, not streamed, told to keep its KV for a remote decode.
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body and "min_tokens" not in p_body
    p_kv = p_body["kv_transfer_params"]
    assert p_kv["do_remote_decode"] is True and p_kv["do_remote_prefill"] is False
    assert (p_kv["remote_host"], p_kv["remote_port"]) == ("127.0.0.1", 7002)  # where the decode side listens
    assert p_kv["transfer_protocol"] == "shm"  # same host id on both: shared memory
    # The decode half: the client's request as sent plus the prefill's returned parameters.
    assert d_body["max_tokens"] == 50 and d_body["stream"] is stream and d_body["min_tokens"] == 5
    d_kv = d_body["kv_transfer_params"]
    assert d_kv["do_remote_prefill"] is True and d_kv["do_remote_decode"] is False
    assert d_kv["remote_block_ids"] == [0, 1] and d_kv["first_token_id"] == 42
    assert (d_kv["remote_host"], d_kv["remote_port"]) == ("127.0.0.1", 7001)  # filled from the registration
    assert d_kv["transfer_protocol"] == "shm"
    assert p_body["request_id"] == d_body["request_id"] == d_kv["remote_request_id"]
    listed = router.client.get("/instances").json()["instances"]
    assert all(i["in_flight"] == 0 for i in listed)
    assert "fastdeploy:router_pd_prefill_seconds_count 1.0" in router.client.get("/metrics").text


def test_sequential_prefill_error_is_passed_through(make_router, fakes):
    router, prefill, decode = pd_router(make_router, fakes, "sequential")
    prefill.fail_status = 400
    resp = router.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "fake error from P"
    assert decode.bodies == []


def test_transfer_protocol_is_tcp_across_hosts(make_router, fakes):
    router = make_router()
    (_, p_server), (decode, d_server) = fakes("P", "prefill"), fakes("D", "decode")
    router.register(p_server, role="prefill", connector_port=7001, host_id="host-a", transfer_protocol="ipc,rdma")
    router.register(d_server, role="decode", connector_port=7002, host_id="host-b", transfer_protocol="ipc,rdma")
    assert router.client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
    assert decode.bodies[0]["kv_transfer_params"]["transfer_protocol"] == "tcp"


def test_requests_pd_cannot_split_go_whole_to_one_instance(make_router, fakes):
    router, prefill, decode = pd_router(make_router, fakes, "sequential")
    resp = router.client.post("/v1/completions", json={"prompt": "x", "n": 2})
    assert resp.status_code == 200
    assert "kv_transfer_params" not in prefill.bodies[0] and decode.bodies == []


def test_pd_preferred_over_mixed_and_mixed_used_without_a_pair(make_router, fakes):
    router, prefill, decode = pd_router(make_router, fakes, "sequential")
    mixed, m_server = fakes("M")
    router.register(m_server)
    router.client.post("/v1/completions", json={"prompt": "x"})
    assert len(decode.bodies) == 1 and mixed.bodies == []
    # n > 1 cannot be split: the mixed instance serves it whole.
    router.client.post("/v1/completions", json={"prompt": "x", "n": 2})
    assert len(mixed.bodies) == 1
    decode.healthy = False
    router.wait_for(lambda: not router.router.pd_ready())
    assert router.client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"] == "served by M"


@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_sends_both_halves_at_once(make_router, fakes, stream):
    router, prefill, decode = pd_router(make_router, fakes, "concurrent")
    resp = router.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "stream": stream})
    assert resp.status_code == 200
    assert "decoded by D from 127.0.0.1:" in resp.text  # the router names P by its address
    # Both halves leave at once: the decode's answer can come back before the prefill's request is read.
    router.wait_for(lambda: len(prefill.bodies) == 1 and len(decode.bodies) == 1)
    [p_body], [d_body] = prefill.bodies, decode.bodies
    p_kv, d_kv = p_body["kv_transfer_params"], d_body["kv_transfer_params"]
    # The prefill pushes to the decode instance's connector; the decode instance expects it from P.
    assert p_kv["do_remote_decode"] and (p_kv["remote_host"], p_kv["remote_port"]) == ("127.0.0.1", 7002)
    assert d_kv["do_remote_prefill"] and (d_kv["remote_host"], d_kv["remote_port"]) == ("127.0.0.1", 7001)
    assert p_kv["mode"] == d_kv["mode"] == "concurrent"
    assert p_body["request_id"] == d_body["request_id"] == d_kv["remote_request_id"]


@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_prefill_failure_aborts_the_decode_half(make_router, fakes, stream):
    router, prefill, decode = pd_router(make_router, fakes, "concurrent")
    prefill.fail_status = 500
    started = time.monotonic()
    # The decode half would wait 20 s for KV that never comes; the prefill's error ends it.
    resp = router.client.post("/v1/completions", json={"prompt": "x", "stream": stream, "fake_delay": 20})
    assert time.monotonic() - started < 10
    if resp.headers["content-type"].startswith("text/event-stream"):
        # The decode stream had started: the error comes as the last event.
        assert stream and resp.status_code == 200
        error = json.loads(events(resp.text)[0])["error"]
    else:
        # The prefill failed before the decode instance answered: a plain error response.
        assert resp.status_code == 500
        error = resp.json()["error"]
    assert error["message"].startswith("Prefill instance 127.0.0.1:")
    assert error["message"].endswith("failed: fake error from P")
    router.wait_for(lambda: decode.cancelled == 1 and decode.in_flight == 0)
