"""Real API server processes for router tests: one thread each, started side by side."""

from __future__ import annotations

from remote_server import RemoteOpenAIServer

SERVER_ARGS = ["--max-model-len", "1024", "--kv-cache-memory-bytes", "134217728", "--max-num-seqs", "16",
               "--disable-log-stats", "--uvicorn-log-level", "warning"]
PROMPTS = ["The capital of France is", "Water boils at", "The largest planet in the solar system is",
           "1, 2, 3, 4,"]


class ApiServer(RemoteOpenAIServer):
    """The API server on a free port with ``extra_args``; returns at once (see :meth:`wait_healthy`)."""

    def __init__(self, *extra_args: str) -> None:
        self.extra_args = list(extra_args)
        # One OMP thread: several servers share the 2 cores.
        super().__init__([*SERVER_ARGS, *extra_args], env={"OMP_NUM_THREADS": "1"}, wait=False)

    @property
    def url(self) -> str:
        return self.url_root

    @property
    def id(self) -> str:
        """The router's id of this instance."""
        return f"127.0.0.1:{self.port}"

    def flag(self, name: str) -> str | None:
        return self.extra_args[self.extra_args.index(name) + 1] if name in self.extra_args else None

    def wait_healthy(self, timeout_s: float = 600) -> None:
        self.wait_for_health(timeout_s)
