"""Start the real API server as a subprocess on a free loopback port (for end-to-end tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

# A small KV cache keeps the server light on this 2-core test machine.
DEFAULT_SERVER_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", "256M", "--max-num-seqs", "128",
                       "--disable-log-stats", "--uvicorn-log-level", "warning"]
MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteOpenAIServer:
    """``python -m fastdeploy.entrypoints.openai.api_server`` in a subprocess, ready once /health is 200."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, api_key: str | None = None,
                 timeout_s: float = 240, cli: bool = False, wait: bool = True) -> None:
        self.port = get_open_port()
        self.api_key = api_key
        # cli=True starts it as `fastdeploy serve ARGS` (the console script's module) instead.
        entry = ["fastdeploy.entrypoints.cli.main", "serve"] if cli else ["fastdeploy.entrypoints.openai.api_server"]
        self.launch([sys.executable, "-m", *entry, *args, "--host", "127.0.0.1", "--port", str(self.port)],
                    {**os.environ, **(env or {})})
        # wait=False lets a test start several servers first (they load their models side by side).
        if wait:
            self.wait_for_health(timeout_s)

    def launch(self, cmd: list[str], env: dict[str, str]) -> None:
        """Start ``cmd`` in its own session (stop() can kill the engine with it), output to a log file."""
        self.log = tempfile.NamedTemporaryFile("w+", prefix="fd-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for_health(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"Server not healthy within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    @property
    def url_root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url_for(self, *parts: str) -> str:
        return "/".join([self.url_root, *parts])

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get_client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.api_key or "EMPTY", max_retries=0, **kwargs)

    def get_async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.api_key or "EMPTY", max_retries=0,
                                  **kwargs)

    def engine_pid(self) -> int:
        """Pid of the engine core child process."""
        import psutil

        children = psutil.Process(self.proc.pid).children()
        for child in children:
            if "multiprocessing.spawn" in " ".join(child.cmdline()) and "resource_tracker" not in " ".join(
                    child.cmdline()):
                return child.pid
        raise RuntimeError(f"No engine process among {[c.cmdline() for c in children]}")

    def metric(self, name: str, **labels: str) -> float:
        """Value of ``name`` on this server's /metrics (0 when the series does not exist yet)."""
        try:
            return metric_value(httpx.get(self.url_for("metrics"), timeout=30).text, name, **labels)
        except KeyError:
            return 0.0

    def kill(self) -> None:
        """SIGKILL the server and its engine process: a crash, not a shutdown."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` (optionally filtered by labels) in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
                found = True
    if not found:
        raise KeyError(f"metric {name} {labels} not found")
    return total
