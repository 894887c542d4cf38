"""A real redis-server on a free loopback port with a temporary directory, per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from redis_process import RedisServer

# The model-free engine core of tests/engine (also importable by the engine processes these tests spawn).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    pytest.importorskip("redis")
    server = RedisServer()
    yield server
    server.stop()
