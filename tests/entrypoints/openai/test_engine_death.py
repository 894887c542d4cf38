"""If the engine process dies: in-flight streams end with an error event, /health is 503, the server exits non-zero."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest
from remote_server import MODEL_NAME, RemoteOpenAIServer

pytestmark = pytest.mark.slow


def test_engine_death_is_reported_and_the_server_exits(tmp_path):
    # Started through `fastdeploy serve MODEL --config FILE`, which this test covers too.
    config = tmp_path / "serve.yaml"
    config.write_text("max-model-len: 512\nkv-cache-memory-bytes: 128M\ndisable-log-stats: true\n")
    server = RemoteOpenAIServer([MODEL_NAME, "--config", str(config)], cli=True)
    try:
        events: list[str] = []
        first_token = threading.Event()

        def stream() -> None:
            body = {"model": MODEL_NAME, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True,
                    "stream": True}
            with httpx.stream("POST", server.url_for("v1", "completions"), json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first_token.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_token.wait(60)
        os.kill(server.engine_pid(), signal.SIGKILL)
        reader.join(30)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == 500 and "engine" in error["message"].lower()

        statuses = []
        deadline = time.monotonic() + 30
        while server.proc.poll() is None and time.monotonic() < deadline:
            try:
                statuses.append(httpx.get(server.url_for("health"), timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert 503 in statuses and 200 not in statuses
        assert server.proc.wait(30) != 0
        assert "max_model_len=512" in server.log_tail(200)
    finally:
        server.stop()
