"""The router over HTTP, in front of fake instances on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import pytest
from fake_llm_instance import free_port

FAKE_SCRIPT = os.path.join(os.path.dirname(__file__), "fake_llm_instance.py")


def served_by(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"].removeprefix("served by ")


def sse_events(text: str) -> list:
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]


def complete(router, prompt: str = "hi", **fields) -> httpx.Response:
    return router.client.post("/v1/completions", json={"model": "fake-model", "prompt": prompt, **fields})


def in_background(fn, *args, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread


def test_round_robin_spreads_evenly(fakes, make_router):
    router = make_router(policy="round_robin")
    servers = [fakes(f"m{i}") for i in range(3)]
    for _, server in servers:
        router.register(server)
    picks = Counter(served_by(complete(router)) for _ in range(9))
    assert picks == Counter({"m0": 3, "m1": 3, "m2": 3})
    chat = router.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200 and servers[0][0].counts["chat"] == 1


@pytest.mark.parametrize("policy", ["request_num", "process_tokens", "power_of_two"])
def test_load_aware_policies_prefer_the_idle_instance(fakes, make_router, policy):
    router = make_router(policy=policy)
    (busy, busy_server), (_, idle_server) = fakes("busy"), fakes("idle")
    router.register(busy_server)
    router.register(idle_server)
    # Force the slow request onto "busy" by making it the only instance for a moment.
    router.client.post("/unregister", json={"host": "127.0.0.1", "port": idle_server.port})
    slow = in_background(complete, router, "a long prompt " * 50, fake_delay=3)
    router.wait_for(lambda: busy.in_flight == 1)
    router.register(idle_server)
    picks = Counter(served_by(complete(router, "short")) for _ in range(4))
    assert picks == Counter({"idle": 4})
    slow.join(10)
    listed = router.instances()
    assert listed[f"127.0.0.1:{busy_server.port}"]["in_flight"] == 0
    assert listed[f"127.0.0.1:{idle_server.port}"]["total_requests"] == 4


def test_cache_aware_keeps_prefixes_together(fakes, make_router):
    router = make_router(policy="cache_aware", cache_block_chars=16)
    fake_servers = [fakes(f"m{i}") for i in range(2)]
    for _, server in fake_servers:
        router.register(server)
    owners: dict[str, set] = {}
    for round_ in range(3):
        for topic in ("cooking", "physics", "music", "history"):
            prompt = f"You are an expert in {topic}. Answer briefly. " * 3 + f"Question {round_}?"
            owners.setdefault(topic, set()).add(served_by(complete(router, prompt)))
    assert all(len(v) == 1 for v in owners.values()), owners
    assert {next(iter(v)) for v in owners.values()} == {"m0", "m1"}


def test_streaming_is_passed_through_chunk_by_chunk(fakes, make_router):
    router = make_router()
    _, server = fakes("m0")
    router.register(server)
    body = {"prompt": "hi", "stream": True, "fake_chunks": 4, "fake_chunk_delay": 0.4}
    started = time.monotonic()
    arrivals, raw = [], b""
    with router.client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for chunk in resp.iter_bytes():
            arrivals.append(time.monotonic() - started)
            raw += chunk
    events = sse_events(raw.decode())
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [f"served by m0 #{i}" for i in range(4)]
    # The first event reached the client long before the last was produced.
    assert len(arrivals) >= 3 and arrivals[0] < arrivals[-1] - 0.8
    direct = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30, trust_env=False)
    assert direct.text == raw.decode()


def test_instance_errors_pass_through_with_their_status(fakes, make_router):
    router = make_router()
    _, server = fakes("m0")
    router.register(server)
    for stream in (False, True):
        resp = complete(router, fake_status=400, stream=stream)
        assert resp.status_code == 400
        assert resp.json()["error"]["message"] == "fake error from m0"
    bad = router.client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"


def test_no_instance_is_a_503(make_router):
    router = make_router()
    resp = complete(router)
    assert resp.status_code == 503
    assert "No healthy mixed instance" in resp.json()["error"]["message"]
    assert router.client.get("/v1/models").status_code == 503


def test_register_listing_models_and_unregister(fakes, make_router):
    router = make_router()
    _, server = fakes("m0")
    bad = router.client.post("/register", json={"role": "teacher", "host": "127.0.0.1", "port": server.port})
    assert bad.status_code == 400 and "Invalid instance role" in bad.json()["error"]["message"]
    router.register(server, model="fake-model", metrics_port=1234)
    listed = router.instances()[f"127.0.0.1:{server.port}"]
    assert listed["healthy"] and listed["role"] == "mixed" and listed["metrics_port"] == 1234
    # Re-registration updates rather than duplicates.
    router.register(server, model="renamed")
    assert len(router.instances()) == 1 and router.instances()[listed["id"]]["model"] == "renamed"
    assert router.client.get("/v1/models").json()["data"][0]["owned_by"] == "m0"
    assert router.client.get("/registered_number").json() == {"mixed": 1, "prefill": 0, "decode": 0}
    assert router.client.post("/unregister", json={"id": listed["id"]}).status_code == 200
    assert router.instances() == {}
    assert router.client.post("/unregister", json={"id": listed["id"]}).status_code == 404
    assert router.client.get("/health").status_code == 200
    metrics = router.client.get("/metrics").text
    assert 'fastdeploy:router_healthy_instances{role="mixed"} 0.0' in metrics


def test_health_checks_remove_and_restore_instances(fakes, make_router):
    router = make_router(policy="round_robin")
    (sick, sick_server), (_, ok_server) = fakes("sick"), fakes("ok")
    router.register(sick_server)
    router.register(ok_server)
    sick_id = f"127.0.0.1:{sick_server.port}"
    sick.healthy = False
    router.wait_for(lambda: not router.instances()[sick_id]["healthy"])
    assert Counter(served_by(complete(router)) for _ in range(4)) == Counter({"ok": 4})
    sick.healthy = True
    router.wait_for(lambda: router.instances()[sick_id]["healthy"])
    assert "sick" in {served_by(complete(router)) for _ in range(4)}


def test_stopped_instance_is_dropped_and_a_restart_serves_again(fakes, make_router):
    router = make_router(policy="round_robin")
    (_, gone_server), (_, ok_server) = fakes("gone"), fakes("ok")
    router.register(gone_server)
    router.register(ok_server)
    gone_id = f"127.0.0.1:{gone_server.port}"
    gone_server.stop()
    router.wait_for(lambda: not router.instances()[gone_id]["healthy"])
    assert Counter(served_by(complete(router)) for _ in range(4)) == Counter({"ok": 4})
    # Restart on the same port; the instance registers again and gets work at once.
    from fake_llm_instance import FakeInstance, ServerThread

    restarted = FakeInstance("restarted")
    server = ServerThread(restarted.app, port=gone_server.port)
    try:
        assert router.register(server)["instance"]["healthy"]
        assert "restarted" in {served_by(complete(router)) for _ in range(4)}
    finally:
        server.stop()


def test_refused_connection_is_retried_on_another_instance(fakes, make_router):
    # Health checks far apart, so the router still believes the stopped instance is healthy.
    router = make_router(policy="round_robin", health_check_interval=60)
    (_, dead_server), (_, ok_server) = fakes("dead"), fakes("ok")
    router.register(dead_server)
    router.register(ok_server)
    dead_server.stop()
    assert [served_by(complete(router)) for _ in range(3)] == ["ok"] * 3
    assert not router.instances()[f"127.0.0.1:{dead_server.port}"]["healthy"]


@pytest.fixture
def killable_fake():
    """A fake instance in its own process that exits when a request says ``fake_die_after``."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, FAKE_SCRIPT, "--port", str(port), "--name", "doomed"],
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1, trust_env=False).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "fake instance did not start"
        time.sleep(0.1)
    yield port, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def test_instance_dying_mid_stream_gives_a_clear_error(killable_fake, fakes, make_router):
    killable_fake, _ = killable_fake
    router = make_router(policy="round_robin", health_check_interval=60)
    _, ok_server = fakes("ok")
    router.client.post("/register", json={"role": "mixed", "host": "127.0.0.1", "port": killable_fake})
    router.register(ok_server)
    resp = complete(router, stream=True, fake_chunks=5, fake_die_after=2, fake_chunk_delay=0.05)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["served by doomed #0",
                                                                         "served by doomed #1"]
    error = json.loads(events[2])["error"]
    assert error["code"] == 502
    assert f"instance 127.0.0.1:{killable_fake} failed while serving the request" in error["message"]
    assert events[3] == "[DONE]"
    # The dead instance gets no more work.
    assert not router.instances()[f"127.0.0.1:{killable_fake}"]["healthy"]
    assert [served_by(complete(router)) for _ in range(2)] == ["ok", "ok"]


def test_instance_dying_mid_request_gives_a_502(killable_fake, make_router):
    killable_fake, proc = killable_fake
    router = make_router(health_check_interval=60)
    router.client.post("/register", json={"role": "mixed", "host": "127.0.0.1", "port": killable_fake})
    # Non-streaming: the instance is killed while the request is being served.
    pending = {}
    thread = in_background(lambda: pending.setdefault("resp", complete(router, fake_delay=30)))
    router.wait_for(lambda: router.instances()[f"127.0.0.1:{killable_fake}"]["in_flight"] == 1)
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    thread.join(20)
    resp = pending["resp"]
    assert resp.status_code == 502
    assert f"Mixed instance 127.0.0.1:{killable_fake} failed while serving the request" in \
        resp.json()["error"]["message"]


def test_role_switch_drains_without_losing_requests(fakes, make_router):
    router = make_router(policy="round_robin")
    (switching, switching_server), (_, other_server) = fakes("switching"), fakes("other")
    router.register(switching_server)
    router.register(other_server)
    switching_id = f"127.0.0.1:{switching_server.port}"
    # A slow request is in flight on the instance when the switch is asked for.
    results = {}
    slow = in_background(lambda: results.setdefault("slow", complete(router, fake_delay=1.5)))
    router.wait_for(lambda: switching.in_flight == 1)
    done = in_background(lambda: results.setdefault(
        "switch", router.client.post("/switch_role", json={"id": switching_id, "role": "decode"})))
    router.wait_for(lambda: router.instances()[switching_id]["draining"])
    # While draining, new work goes elsewhere.
    assert [served_by(complete(router)) for _ in range(3)] == ["other"] * 3
    slow.join(10)
    done.join(10)
    assert served_by(results["slow"]) == "switching"
    assert results["switch"].status_code == 200, results["switch"].text
    assert results["switch"].json()["previous_role"] == "mixed"
    assert switching.role == "decode" and router.instances()[switching_id]["role"] == "decode"
    assert not router.instances()[switching_id]["draining"]
    # It is a decode instance now: mixed traffic no longer reaches it.
    assert [served_by(complete(router)) for _ in range(2)] == ["other"] * 2
    unknown = router.client.post("/switch_role", json={"id": "127.0.0.1:1", "role": "decode"})
    assert unknown.status_code == 404
