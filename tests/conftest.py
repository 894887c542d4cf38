"""Shared fixtures: one engine on the real default model per test session."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol_llm():
    """The embedded SmolLM2-135M-Instruct behind ``LLM``, with a small KV cache."""
    from fastdeploy import LLM

    return LLM(max_model_len=2048, kv_cache_memory_bytes=256 << 20, max_num_seqs=32)
