"""The router in front of two real API servers (data parallelism), driven by the openai SDK."""

from __future__ import annotations

import openai
import pytest
from real_server import PROMPTS, ApiServer


@pytest.fixture(scope="module")
def two_servers():
    servers = [ApiServer(), ApiServer()]  # both load the model at the same time
    try:
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.mark.slow
def test_router_over_two_real_instances(two_servers, make_router):
    router = make_router(policy="round_robin", health_check_interval=2.0, health_check_timeout=10.0,
                         health_failure_threshold=3)
    for server in two_servers:
        router.client.post("/register", json={"role": "mixed", "host": "127.0.0.1", "port": server.port})
    via_router = openai.OpenAI(base_url=f"{router.url}/v1", api_key="EMPTY", max_retries=0, timeout=300)
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{two_servers[0].port}/v1", api_key="EMPTY", max_retries=0,
                           timeout=300)
    model = via_router.models.list().data[0].id
    for prompt in PROMPTS:
        kwargs = dict(model=model, prompt=prompt, max_tokens=12, temperature=0)
        assert via_router.completions.create(**kwargs).choices[0].text == \
            direct.completions.create(**kwargs).choices[0].text
    # Streaming chat through the router equals the non-streamed answer of one instance.
    # A phrasing both the GGUF default and the dequantized path answer with Paris (tests/entrypoints/test_llm.py).
    messages = [{"role": "user", "content": "Name the capital of France."}]
    expected = direct.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                              temperature=0).choices[0].message.content
    chunks = [c.choices[0].delta.content or "" for c in via_router.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True) if c.choices]
    assert len(chunks) > 2 and "".join(chunks) == expected
    assert "Paris" in expected
    served = {i["port"]: i["total_requests"] for i in router.client.get("/instances").json()["instances"]}
    assert all(count >= 2 for count in served.values()), served


def prefix_cache_hits(servers) -> float:
    """Sum of vllm:prefix_cache_hits_total over the instances."""
    return sum(server.metric("vllm:prefix_cache_hits_total") for server in servers)


@pytest.mark.slow
def test_cache_aware_beats_round_robin_on_prefix_cache_hits(two_servers, make_router):
    """Three long shared prefixes, four rounds: round robin alternates each prefix between the two
    instances (two cold misses per prefix), cache_aware keeps each on one instance (one miss)."""
    hits = {}
    for policy in ("round_robin", "cache_aware"):
        router = make_router(policy=policy, health_check_interval=2.0, health_check_timeout=10.0,
                             health_failure_threshold=3)
        for server in two_servers:
            router.client.post("/register", json={"role": "mixed", "host": "127.0.0.1", "port": server.port})
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="EMPTY", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        before = prefix_cache_hits(two_servers)
        for round_ in range(4):
            for topic in ("astronomy", "gardening", "chess"):
                # A fresh set of prefixes per policy, so the first policy's cache does not help the second.
                prefix = f"[{policy}] You are a patient expert in {topic}. " * 12
                client.completions.create(model=model, prompt=f"{prefix}Question {round_}:", max_tokens=1,
                                          temperature=0)
        hits[policy] = prefix_cache_hits(two_servers) - before
    assert hits["cache_aware"] > hits["round_robin"] > 0, hits
