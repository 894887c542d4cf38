"""Two real API servers under ``--scheduler-name global`` sharing a real redis-server (the default model)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from real_server import ApiServer as RouterTestServer
from redis_process import RedisServer

# --max-num-seqs 2: one instance cannot take all the work at once, so the other has some to take.
SERVER_ARGS = ["--max-num-seqs", "2"]
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet in the solar system is",
           "1, 2, 3, 4,", "My favourite colour is", "The first president of the United States was",
           "Photosynthesis is the process", "In 1969, the first man on the moon"]
TAKEN = "fastdeploy:global_scheduler_requests_taken_total"


class ApiServer(RouterTestServer):
    """A real API server (tests/router/real_server.py) with this engine's take counters."""

    def __init__(self, *extra_args: str) -> None:
        super().__init__(*SERVER_ARGS, *extra_args)

    def taken(self) -> dict[str, float]:
        """This engine's fastdeploy:global_scheduler_requests_taken_total by source."""
        return {source: self.metric(TAKEN, source=source) for source in ("own", "stolen")}


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[RedisServer, ApiServer, ApiServer]]:
    """A redis-server and two instances on the same topic (the documented command, one port each)."""
    pytest.importorskip("redis")
    redis = RedisServer()
    flags = ["--scheduler-name", "global", "--scheduler-host", "127.0.0.1", "--scheduler-port", str(redis.port),
             "--scheduler-topic", "e2e"]
    servers = [ApiServer(*flags), ApiServer(*flags)]  # both load the model at the same time
    try:
        for server in servers:
            server.wait_healthy()
        yield redis, servers[0], servers[1]
    finally:
        for server in servers:
            server.stop()
        redis.stop()


def complete(server: ApiServer, prompt: str, stream: bool = False) -> str:
    # Answers long enough that A is still busy with its first two when B next polls Redis (every 50 ms).
    body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": stream}
    if not stream:
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120, trust_env=False)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    import json

    text = ""
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120, trust_env=False) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                assert "error" not in chunk, chunk
                text += "".join(choice["text"] for choice in chunk["choices"])
    return text


@pytest.mark.slow
def test_work_submitted_to_one_instance_is_completed_by_both(cluster):
    _, a, b = cluster
    # One at a time, A runs each request itself (its own queue comes first, and it has room).
    reference = [complete(a, prompt) for prompt in PROMPTS]
    before = a.taken(), b.taken()
    # All at once (every other one streamed) to A: more than it has room for, so B takes some.
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda ip: complete(a, ip[1], stream=ip[0] % 2 == 1), enumerate(PROMPTS)))
    assert answers == reference
    deadline = time.monotonic() + 10
    while True:  # the counts come with the engines' step stats
        a_after, b_after = a.taken(), b.taken()
        a_own, a_stolen = (a_after[s] - before[0].get(s, 0) for s in ("own", "stolen"))
        b_own, b_stolen = (b_after[s] - before[1].get(s, 0) for s in ("own", "stolen"))
        if a_own + b_stolen == len(PROMPTS) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # Where each request RAN: the engines' own counts of the requests they took from Redis.
    assert a_own + b_stolen == len(PROMPTS) and a_stolen == 0 and b_own == 0
    assert a_own > 0 and b_stolen > 0, f"A ran {a_own}, B ran {b_stolen}: both should have run some"


@pytest.mark.slow
def test_redis_stopping_is_a_clear_error_not_a_hang(cluster):
    redis, a, b = cluster
    redis.stop()
    started = time.monotonic()
    response = httpx.post(f"{a.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 8}, timeout=30,
                          trust_env=False)
    assert time.monotonic() - started < 5
    assert response.status_code >= 500
    message = response.json()["error"]["message"]
    assert f"cannot reach Redis at 127.0.0.1:{redis.port}" in message, message
    # The servers stay up and healthy (the engines work; only sharing through Redis is down).
    for server in (a, b):
        assert server.proc.poll() is None
        assert httpx.get(f"{server.url}/health", timeout=5, trust_env=False).status_code == 200
