"""One real server (default model, small KV cache) shared by the end-to-end tests of this folder."""

from __future__ import annotations

import psutil
import pytest
from remote_server import DEFAULT_SERVER_ARGS, RemoteOpenAIServer, get_open_port

API_KEY = "test-key"


@pytest.fixture(scope="session")
def server():
    # The key comes from the environment (FD_API_KEY), exercising that path; --metrics-port adds a port.
    # --enable-per-request-metrics needs the engine's statistics, so this server keeps them on.
    metrics_port = get_open_port()
    args = [arg for arg in DEFAULT_SERVER_ARGS if arg != "--disable-log-stats"]
    srv = RemoteOpenAIServer([*args, "--metrics-port", str(metrics_port), "--enable-tokenizer-info-endpoint",
                              "--enable-prompt-tokens-details", "--enable-per-request-metrics"],
                             env={"FD_API_KEY": API_KEY}, api_key=API_KEY)
    srv.metrics_port = metrics_port
    engine_pid = srv.engine_pid()
    try:
        yield srv
    finally:
        # SIGTERM shuts the server down cleanly: exit code 0 and no engine process left behind.
        assert srv.stop() == 0, srv.log_tail()
        assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture(scope="session")
def client(server):
    return server.get_client()


@pytest.fixture
def anyio_backend():
    return "asyncio"
