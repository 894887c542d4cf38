"""Fixtures of the benchmark tests: the default model's tokenizer (offline, from the embedded GGUF)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    return get_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
