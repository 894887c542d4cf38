"""bf16 (the C++ kernels' default on CPUs with bf16 units) and the GGUF file's own blocks (the default for a
GGUF file) keep the model's quality: perplexity within 1% of the file dequantized in fp32."""

import pytest

from fastdeploy import LLM
from fastdeploy.platforms import current_platform

pytestmark = pytest.mark.slow

BF16_MISSING = current_platform.bf16_unavailable_reason() if current_platform.is_cpu() else "not a CPU"


def test_bf16_and_gguf_blocks_perplexity_within_one_percent_of_fp32(smol_llm):
    from benchmarks.benchmark_perplexity import english_text, perplexity, token_windows

    text, _ = english_text("pydoc", max_chars=20_000)
    windows = token_windows(smol_llm.get_tokenizer(), text, window=384, max_tokens=1536)
    assert smol_llm.llm_engine.engine_core.fd_config.model_config.quantization == "gguf"  # a GGUF's default
    gguf, count = perplexity(smol_llm, windows)
    engine = dict(max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    fp32, _ = perplexity(LLM(dtype="float32", quantization="none", **engine), windows)
    assert count == len(windows) * 383
    assert abs(gguf / fp32 - 1) < 0.01, (gguf, fp32)
    if BF16_MISSING is not None:
        pytest.skip(f"gguf checked; no bf16 on this machine: {BF16_MISSING}")
    bf16_llm = LLM(quantization="none", **engine)
    assert bf16_llm.llm_engine.engine_core.fd_config.model_config.dtype == "bfloat16"  # "auto" picked bf16
    bf16, _ = perplexity(bf16_llm, windows)
    assert abs(bf16 / fp32 - 1) < 0.01, (bf16, fp32)
