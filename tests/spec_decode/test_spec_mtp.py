"""MTP speculation (and a DeepSeek draft model) on a tiny random DeepSeek-V3 checkpoint with one MTP module: greedy
output unchanged."""

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from tests.model_executor.models.test_deepseek_mtp import mtp_checkpoint  # noqa: F401  (the fixture)

KW = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=128, max_num_batched_tokens=24,
          kv_cache_memory_bytes=16 << 20)


def _prompts(vocab):
    rng = np.random.default_rng(5)
    shared = rng.integers(1, vocab, size=12).tolist()
    return [shared + [3], shared + [4, 5], rng.integers(1, vocab, size=40).tolist(), [7, 8, 9]]


def test_mtp_greedy_identical_to_plain_decoding(mtp_checkpoint):  # noqa: F811
    path, config = mtp_checkpoint[0], mtp_checkpoint[1]
    prompts = [{"prompt_token_ids": p} for p in _prompts(config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, **KW).generate(prompts, params)]
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **KW)
    for _ in range(2):  # the second time the shared prefix is a cache hit
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.llm_engine.spec_decode_totals.stats.num_drafts > 0


def test_an_mla_draft_model_keeps_its_latent_cache(mtp_checkpoint):  # noqa: F811
    """draft_model with a DeepSeek draft (here the target itself): its cache is sized and shaped from its latent
    spec, so every draft is the target's own token and all are accepted."""
    path, config = mtp_checkpoint[0], mtp_checkpoint[1]
    prompts = [{"prompt_token_ids": p} for p in _prompts(config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(path, **KW).generate(prompts, params)]
    llm = LLM(path, speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2}, **KW)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    stats = llm.llm_engine.spec_decode_totals.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def test_mtp_needs_mtp_modules(tmp_path):
    from tests.model_executor.utils import build_tiny_checkpoint

    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **KW)
