"""Router + real prefill, decode and mixed instances: disaggregated serving end to end.

One prefill (P), one decode (D) and one mixed instance (M, with a KV connector so it can
switch role) run as separate server processes; M's direct answers are the reference.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from fake_llm_instance import free_port
from real_server import PROMPTS, ApiServer

pytestmark = pytest.mark.slow

RECV = {"direction": "recv"}


def pd_flags(role: str) -> list[str]:
    return ["--splitwise-role", role, "--pd-comm-port", str(free_port()), "--cache-transfer-protocol", "ipc,rdma"]


@pytest.fixture(scope="module")
def cluster():
    servers = {"P": ApiServer(*pd_flags("prefill")), "D": ApiServer(*pd_flags("decode")),
               "M": ApiServer(*pd_flags("mixed"))}
    try:
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def register(router, server: ApiServer, role: str) -> None:
    resp = router.client.post("/register", json={
        "role": role, "host": "127.0.0.1", "port": server.port, "connector_port": int(server.flag("--pd-comm-port")),
        "transfer_protocol": ["shm", "tcp"]})
    assert resp.status_code == 200, resp.text


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="EMPTY", max_retries=0, timeout=300)


def expected_texts(server: ApiServer, prompts: list[str], max_tokens: int) -> dict[str, str]:
    direct = client(server.url)
    model = direct.models.list().data[0].id
    return {p: direct.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0)
            .choices[0].text for p in prompts}


def wait_until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.1)


@pytest.mark.parametrize("protocol", ["sequential", "concurrent"])
def test_prefill_decode_pair_matches_a_mixed_instance(cluster, make_router, protocol):
    prefill, decode, mixed = cluster["P"], cluster["D"], cluster["M"]
    router = make_router(pd_protocol=protocol, health_check_interval=2.0, health_check_timeout=10.0,
                         health_failure_threshold=3)
    register(router, prefill, "prefill")
    register(router, decode, "decode")
    received_before = decode.metric("fastdeploy:kv_transfer_requests_total", **RECV)
    via_router, direct = client(router.url), client(mixed.url)
    model = direct.models.list().data[0].id
    for prompt in PROMPTS:
        kwargs = dict(model=model, prompt=prompt, max_tokens=12, temperature=0)
        expected = direct.completions.create(**kwargs).choices[0].text
        assert via_router.completions.create(**kwargs).choices[0].text == expected
        streamed = "".join(c.choices[0].text for c in via_router.completions.create(**kwargs, stream=True)
                           if c.choices)
        assert streamed == expected
    # A phrasing both the GGUF default and the dequantized path answer with Paris (tests/entrypoints/test_llm.py).
    messages = [{"role": "user", "content": "Name the capital of France."}]
    expected = direct.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                              temperature=0).choices[0].message.content
    chunks = [c.choices[0].delta.content or "" for c in via_router.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True) if c.choices]
    assert "".join(chunks) == expected and "Paris" in expected
    # Every answer's prompt KV really came over the connector, and the prefill side let go of it.
    assert decode.metric("fastdeploy:kv_transfer_requests_total", **RECV) - received_before == 2 * len(PROMPTS) + 1
    assert decode.metric("fastdeploy:kv_transfer_bytes_total", **RECV) > 0
    wait_until(lambda: prefill.metric("fastdeploy:kv_cache_used_blocks") == 0, what="prefill blocks freed")


def test_role_switch_under_load_loses_no_request(cluster, make_router):
    prefill, decode, mixed = cluster["P"], cluster["D"], cluster["M"]
    prompts = [f"Question {i}: name a famous scientist and say why." for i in range(10)]
    expected = expected_texts(mixed, prompts, max_tokens=24)
    router = make_router(health_check_interval=2.0, health_check_timeout=10.0, health_failure_threshold=3)
    register(router, prefill, "prefill")
    register(router, decode, "decode")
    register(router, mixed, "mixed")
    model = client(router.url).models.list().data[0].id
    results: dict[str, str | BaseException] = {}

    def ask(prompt: str) -> None:
        try:
            results[prompt] = client(router.url).completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        except BaseException as e:  # reported by the assertion below
            results[prompt] = e

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts[:6]]
    for thread in threads:
        thread.start()
    wait_until(lambda: router.instances()[decode.id]["in_flight"] > 0, what="decode instance busy")
    switch: dict[str, httpx.Response] = {}
    switcher = threading.Thread(target=lambda: switch.update(resp=router.client.post(
        "/switch_role", json={"id": decode.id, "role": "mixed"}, timeout=300)))
    switcher.start()
    wait_until(lambda: router.instances()[decode.id]["draining"], what="drain started")
    # New work keeps arriving while the decode instance drains.
    late = [threading.Thread(target=ask, args=(p,)) for p in prompts[6:]]
    for thread in late:
        thread.start()
    for thread in [*threads, *late, switcher]:
        thread.join(300)
    assert switch["resp"].status_code == 200, switch["resp"].text
    assert router.instances()[decode.id]["role"] == "mixed"
    assert httpx.get(f"{decode.url}/role", trust_env=False).json() == {"role": "mixed"}
    assert results == expected  # nothing lost, nothing changed
    # Switched back, the instance decodes for the prefill instance again.
    resp = router.client.post("/switch_role", json={"id": decode.id, "role": "decode"}, timeout=300)
    assert resp.status_code == 200, resp.text
    received = decode.metric("fastdeploy:kv_transfer_requests_total", **RECV)
    ask(prompts[0])
    assert results[prompts[0]] == expected[prompts[0]]
    assert decode.metric("fastdeploy:kv_transfer_requests_total", **RECV) == received + 1


def test_an_instance_without_a_connector_cannot_become_prefill(make_router):
    plain = ApiServer()
    try:
        plain.wait_healthy()
        resp = httpx.post(f"{plain.url}/switch_role", json={"role": "prefill"}, timeout=60, trust_env=False)
        assert resp.status_code == 400 and "without a KV connector" in resp.json()["error"]["message"]
        assert httpx.get(f"{plain.url}/role", trust_env=False).json() == {"role": "mixed"}
    finally:
        plain.stop()


def test_killing_the_decode_instance_mid_request(cluster, make_router):
    """Runs last in this module: it kills the cluster's decode instance."""
    prefill, decode, mixed = cluster["P"], cluster["D"], cluster["M"]
    router = make_router(health_check_interval=0.5, health_check_timeout=5.0, health_failure_threshold=1)
    register(router, prefill, "prefill")
    register(router, decode, "decode")
    register(router, mixed, "mixed")
    events: list[str] = []
    body = {"model": client(mixed.url).models.list().data[0].id, "prompt": "Tell me a very long story.",
            "max_tokens": 600, "ignore_eos": True, "temperature": 0, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=300, trust_env=False) as resp:
            try:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
            except httpx.HTTPError as e:
                events.append(f"client error: {e}")

    reader = threading.Thread(target=stream)
    reader.start()
    wait_until(lambda: len(events) >= 5, what="first streamed tokens")
    decode.kill()
    reader.join(60)
    assert not reader.is_alive()
    # The client is told, instead of the stream just stopping.
    assert events[-1] == "[DONE]" or events[-1].startswith("client error")
    errors = [json.loads(e)["error"] for e in events if e.startswith("{") and "error" in json.loads(e)]
    assert errors and decode.id in errors[0]["message"], events[-3:]
    assert len(events) < 600
    # The prefill side's blocks are free, and the router stops sending work to the dead instance.
    wait_until(lambda: prefill.metric("fastdeploy:kv_cache_used_blocks") == 0, what="prefill blocks freed")
    wait_until(lambda: decode.id not in router.instances() or not router.instances()[decode.id]["healthy"],
               what="decode instance dropped")
    answer = client(router.url).completions.create(model=body["model"], prompt=PROMPTS[0], max_tokens=8,
                                                   temperature=0)
    assert answer.choices[0].text == expected_texts(mixed, PROMPTS[:1], 8)[PROMPTS[0]]
    # A restarted decode instance registers itself (--router) and serves disaggregated requests again.
    restarted = ApiServer(*pd_flags("decode"), "--router", router.url)
    cluster["D"] = restarted  # stopped with the cluster
    restarted.wait_healthy()
    wait_until(lambda: router.instances().get(restarted.id, {}).get("healthy") is True, what="re-registration")
    assert router.instances()[restarted.id]["role"] == "decode"
    answer = client(router.url).completions.create(model=body["model"], prompt=PROMPTS[1], max_tokens=8,
                                                   temperature=0)
    assert answer.choices[0].text == expected_texts(mixed, PROMPTS[1:2], 8)[PROMPTS[1]]
    assert restarted.metric("fastdeploy:kv_transfer_requests_total", **RECV) == 1
