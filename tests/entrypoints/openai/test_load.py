"""Many concurrent streams complete; aborted streams leave no KV blocks in use; metrics move."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from remote_server import MODEL_NAME, metric_value

pytestmark = pytest.mark.slow


def _metrics(server) -> str:
    return httpx.get(server.url_for("metrics")).text


def _wait_idle(server, timeout_s: float = 30) -> str:
    """Metrics once the engine has no running or waiting request."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = _metrics(server)
        busy = metric_value(text, "vllm:num_requests_running") + metric_value(text, "vllm:num_requests_waiting")
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


async def _stream_text(client, i: int) -> tuple[str, str | None]:
    stream = await client.completions.create(model=MODEL_NAME, prompt=f"Request number {i}:", max_tokens=6,
                                             temperature=0.8, seed=i, stream=True)
    text, reason = "", None
    async for chunk in stream:
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.anyio
async def test_64_concurrent_streams_complete(server):
    async with server.get_async_client(timeout=120) as client:
        results = await asyncio.gather(*(_stream_text(client, i) for i in range(64)))
    assert len(results) == 64
    assert all(reason in ("length", "stop") for _, reason in results)


@pytest.mark.anyio
async def test_aborted_streams_free_their_kv_blocks(server):
    async def start_and_drop(http: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL_NAME, "prompt": f"Write a long story number {i}.", "max_tokens": 1500,
                "stream": True, "ignore_eos": True}
        async with http.stream("POST", server.url_for("v1", "completions"), json=body, headers=server.headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    return  # leave after the first token: the connection closes mid-stream

    async with httpx.AsyncClient(timeout=120) as http:
        await asyncio.gather(*(start_and_drop(http, i) for i in range(100)))
    text = _wait_idle(server)
    assert metric_value(text, "fastdeploy:kv_cache_used_blocks") == 0
    assert metric_value(text, "vllm:num_requests_running") == 0
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") >= 100


def test_metrics_counters_move(server, client):
    before = _wait_idle(server)
    client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=4, temperature=0)
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=50,
                                   temperature=0)
    after = _wait_idle(server)

    def delta(name: str, **labels: str) -> float:
        return metric_value(after, name, **labels) - metric_value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") >= 5
    assert delta("vllm:generation_tokens_total") >= 5
    assert delta("vllm:request_success_total", finished_reason="length") >= 1
    assert delta("vllm:request_success_total", finished_reason="stop") >= 1
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_prompt_tokens_count") == 2
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:inter_token_latency_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:request_generation_tokens_count"):
        metric_value(after, name, model_name=MODEL_NAME)
    # As vLLM, the speculative decoding counters exist only with speculative decoding (not configured here).
    assert "vllm:spec_decode" not in after


@pytest.mark.anyio
async def test_client_disconnect_aborts_non_streaming_request(server):
    before = metric_value(_wait_idle(server), "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL_NAME, "prompt": "Write an essay.", "max_tokens": 400, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(server.url_for("v1", "completions"), json=body, headers=server.headers)
    text = _wait_idle(server, timeout_s=10)
    assert metric_value(text, "vllm:request_success_total", finished_reason="abort") == before + 1
    assert metric_value(text, "fastdeploy:kv_cache_used_blocks") == 0


@pytest.mark.anyio
async def test_load_counts_requests_in_flight(server):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", server.url_for("v1", "completions"), json=body, headers=server.headers) as r:
            # Keep the line iterator referenced: dropping it closes the connection.
            lines = r.aiter_lines()
            await anext(lines)
            assert (await http.get(server.url_for("load"))).json()["server_load"] == 1
            await lines.aclose()
    await asyncio.sleep(0.5)
    assert httpx.get(server.url_for("load")).json()["server_load"] == 0
