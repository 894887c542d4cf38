"""Shared fixtures: one engine on the real default model per test session; fastdeploy's log lines for caplog."""

import logging
import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol_llm():
    """The embedded SmolLM2-135M-Instruct behind ``LLM``, with a small KV cache."""
    from fastdeploy import LLM

    return LLM(max_model_len=2048, kv_cache_memory_bytes=256 << 20, max_num_seqs=32)


@pytest.fixture
def fd_logs(caplog):
    """The fastdeploy logger does not propagate to the root logger; let caplog see it."""
    logger = logging.getLogger("fastdeploy")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="fastdeploy")
    yield caplog
    logger.removeHandler(caplog.handler)
