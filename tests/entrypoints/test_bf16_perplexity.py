"""bf16 (the C++ kernels' default on CPUs with bf16 units) keeps the model's quality: perplexity within 1% of fp32."""

import pytest

from fastdeploy import LLM
from fastdeploy.platforms import current_platform

pytestmark = pytest.mark.slow


@pytest.mark.skipif(
    current_platform.bf16_unavailable_reason() is not None if current_platform.is_cpu() else True,
    reason="no bf16 on this machine",
)
def test_bf16_perplexity_within_one_percent_of_fp32(smol_llm):
    from benchmarks.benchmark_perplexity import english_text, perplexity, token_windows

    text, _ = english_text("pydoc", max_chars=20_000)
    windows = token_windows(smol_llm.get_tokenizer(), text, window=384, max_tokens=1536)
    assert smol_llm.llm_engine.engine_core.fd_config.model_config.dtype == "bfloat16"  # "auto" picked bf16
    bf16, count = perplexity(smol_llm, windows)
    fp32, _ = perplexity(LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20), windows)
    assert count == len(windows) * 383
    assert abs(bf16 / fp32 - 1) < 0.01, (bf16, fp32)
