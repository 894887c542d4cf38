"""The FastAPI app of api_server without an engine: --root-path, and the pieces of per-request metrics."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from fastdeploy.entrypoints.openai.api_server import build_app, create_server_socket
from fastdeploy.entrypoints.openai.cli_args import create_parser
from fastdeploy.entrypoints.openai.protocol import PerRequestTimingMetrics


def app_with(*argv: str) -> TestClient:
    app = build_app(create_parser().parse_args(list(argv)))
    # /health reads only whether the engine is alive.
    app.state.engine_client = SimpleNamespace(errored=False)
    return TestClient(app)


def test_root_path_serves_under_the_prefix_and_at_the_root():
    """--root-path (FastAPI's root_path, as vLLM): behind a proxy that keeps the prefix the routes
    answer under /llm, and they still answer without it; the API key guards /v1 either way."""
    client = app_with("--root-path", "/llm", "--api-key", "k")
    assert client.get("/llm/health").status_code == 200
    assert client.get("/health").status_code == 200
    for path in ("/llm/v1/models", "/v1/models"):
        r = client.get(path, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert client.get("/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_per_request_timings_from_timestamps():
    """vLLM's definitions: from scheduling; tokens/s over scheduled .. last token, prefill included."""
    m = PerRequestTimingMetrics.from_timestamps(100.0, 100.25, 100.75, 102.75, num_generation_tokens=5)
    assert m.queue_time_ms == pytest.approx(250.0)
    assert m.time_to_first_token_ms == pytest.approx(500.0)
    assert m.generation_time_ms == pytest.approx(2000.0)
    assert m.mean_itl_ms == pytest.approx(500.0)
    assert m.tokens_per_second == pytest.approx(5 / 2.5)
    one = PerRequestTimingMetrics.from_timestamps(100.0, 100.25, 100.75, 100.75, num_generation_tokens=1)
    assert one.mean_itl_ms is None and one.tokens_per_second == pytest.approx(1 / 0.5)
    missing = PerRequestTimingMetrics.from_timestamps(100.0, None, None, None, num_generation_tokens=3)
    assert missing.model_dump() == dict.fromkeys(missing.model_dump())


def test_served_connections_send_without_nagle():
    """A response's body must not wait for the client's delayed ACK of its headers (~40 ms)."""

    async def accepted_nodelay() -> int:
        listener = create_server_socket("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Protocol, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            try:
                return await asyncio.wait_for(seen, 10)
            finally:
                writer.close()

    assert asyncio.run(accepted_nodelay()) != 0
