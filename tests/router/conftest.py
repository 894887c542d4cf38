"""Fixtures: fake instances and a router, each a uvicorn server on a loopback port in a thread."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The real-server helper of the OpenAI end-to-end tests (tests/router/real_server.py builds on it).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "entrypoints", "openai"))

from fake_llm_instance import FakeInstance, ServerThread  # noqa: E402

from fastdeploy.router.app import build_app  # noqa: E402
from fastdeploy.router.router import Router, RouterArgs  # noqa: E402


class RunningRouter:
    """A router in a thread with a sync client to it."""

    def __init__(self, args: RouterArgs) -> None:
        self.router = Router(args)
        self.server = ServerThread(build_app(self.router))
        self.client = httpx.Client(base_url=self.server.url, timeout=30, trust_env=False)

    @property
    def url(self) -> str:
        return self.server.url

    def register(self, fake_server: ServerThread, role: str = "mixed", **extra) -> dict:
        resp = self.client.post("/register", json={"role": role, "host": "127.0.0.1", "port": fake_server.port,
                                                   **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def instances(self) -> dict[str, dict]:
        return {i["id"]: i for i in self.client.get("/instances").json()["instances"]}

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout} s; instances: {self.instances()}")
            time.sleep(0.05)

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture
def fakes() -> Iterator[Callable[..., tuple[FakeInstance, ServerThread]]]:
    """Factory of fake instances running in threads; all stopped at the end of the test."""
    started: list[ServerThread] = []

    def make(name: str, role: str = "mixed") -> tuple[FakeInstance, ServerThread]:
        fake = FakeInstance(name, role)
        server = ServerThread(fake.app)
        started.append(server)
        return fake, server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def make_router() -> Iterator[Callable[..., RunningRouter]]:
    """Factory of routers (fast health checks unless overridden)."""
    routers: list[RunningRouter] = []

    def make(**kwargs) -> RunningRouter:
        kwargs.setdefault("health_check_interval", 0.2)
        kwargs.setdefault("health_check_timeout", 2.0)
        kwargs.setdefault("health_failure_threshold", 1)
        kwargs.setdefault("uvicorn_log_level", "warning")
        running = RunningRouter(RouterArgs(**kwargs))
        routers.append(running)
        return running

    yield make
    for running in routers:
        running.close()
