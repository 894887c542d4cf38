"""A real redis-server on a free loopback port with a temporary directory, per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from redis_process import RedisServer

# The model-free engine core of tests/engine (also importable by the engine processes these tests spawn).
_TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_TESTS, "engine"))
# Real API server processes: tests/router/real_server.py on tests/entrypoints/openai/remote_server.py.
sys.path.insert(0, os.path.join(_TESTS, "router"))
sys.path.insert(0, os.path.join(_TESTS, "entrypoints", "openai"))


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    pytest.importorskip("redis")
    server = RedisServer()
    yield server
    server.stop()
