"""Our models against transformers: logits and greedy decoding through the paged cache.

Tiny random checkpoints of every architecture are written with transformers at test
time; the real SmolLM2 GGUF is compared against transformers loading the same file.
"""

import os

import numpy as np
import pytest

from fastdeploy.model_executor.models.registry import ModelRegistry
from tests.model_executor.utils import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    TINY_VOCAB,
    PagedRunner,
    build_tiny_checkpoint,
    greedy_generate,
    hf_greedy,
    hf_logits,
    load_hf_model,
    load_our_model,
    named_weights,
    prefill_logits,
)


@pytest.fixture(scope="module", params=ARCHITECTURES + MOE_ARCHITECTURES)
def tiny(request, tmp_path_factory):
    """(architecture, our model, transformers model, checkpoint folder) of one tiny random checkpoint."""
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, load_our_model(path), load_hf_model(path), path


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(3, TINY_VOCAB, n).tolist()


def test_model_class(tiny):
    arch, ours, _, _ = tiny
    assert type(ours) is ModelRegistry.resolve_model_cls([arch])
    assert (ours.num_layers, ours.num_kv_heads) == (2, 2)


def test_prefill_logits_match(tiny):
    _, ours, hf, _ = tiny
    prompt = _prompt(13)
    np.testing.assert_allclose(prefill_logits(ours, prompt), hf_logits(hf, prompt), atol=1e-4, rtol=0)


@pytest.mark.parametrize("prefill_chunk", [None, 5])
def test_greedy_decode_matches_generate(tiny, prefill_chunk):
    _, ours, hf, _ = tiny
    prompt = _prompt(11, seed=1)
    want = hf_greedy(hf, prompt, 32)
    got, first_logits = greedy_generate(ours, prompt, 32, block_size=4, prefill_chunk=prefill_chunk)
    assert got == want
    np.testing.assert_allclose(first_logits, hf_logits(hf, prompt)[-1], atol=1e-4, rtol=0)


def test_mixed_batch_equals_separate(tiny):
    """2 decodes + 2 prefills (one a later chunk over cached context) in one forward."""
    _, ours, _, _ = tiny
    prompts = {sid: _prompt(n, seed=10 + i) for i, (sid, n) in enumerate([("a", 6), ("b", 9), ("c", 7), ("d", 10)])}
    batched = PagedRunner(ours, num_blocks=64, block_size=4, seed=3)
    for sid, p in prompts.items():
        batched.add(sid, p + [5])
    batched.step([("a", 6), ("b", 9), ("d", 4)])  # d: first chunk only
    mixed = batched.step([("a", 1), ("b", 1), ("c", 7), ("d", 6)]).numpy()

    for row, (sid, chunks) in enumerate([("a", [6, 1]), ("b", [9, 1]), ("c", [7]), ("d", [4, 6])]):
        alone = PagedRunner(ours, num_blocks=16, block_size=4, seed=row)
        alone.add(sid, prompts[sid] + [5])
        for n in chunks:
            logits = alone.step([(sid, n)])
        np.testing.assert_allclose(mixed[row], logits.numpy()[0], atol=1e-5, rtol=0)


def test_missing_weight_is_reported(tiny):
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import get_weights_iterator

    _, ours, _, path = tiny
    weights = [(n, w) for n, w in get_weights_iterator(ModelConfig(model=path)) if "layers.1.self_attn.k_proj" not in n]
    with pytest.raises(ValueError, match="missing"):
        type(ours)(ours.config).load_weights(weights)


def test_sliding_window_is_refused_where_a_request_could_outgrow_it(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs
    from tests.model_executor.utils import build_tiny_checkpoint

    path = build_tiny_checkpoint("Qwen2ForCausalLM", tmp_path, use_sliding_window=True, sliding_window=32,
                                 max_window_layers=1)
    with pytest.raises(ValueError, match=r"sliding_window=32 on 1 of 2 layers.*max_model_len=64.*--max-model-len 32"):
        EngineArgs(model=path, max_model_len=64, skip_tokenizer_init=True).create_engine_config()
    # Inside the window every layer sees the same keys as full attention.
    config = EngineArgs(model=path, max_model_len=32, skip_tokenizer_init=True).create_engine_config()
    assert config.model_config.max_model_len == 32
    # Qwen3-MoE has no layer_types: transformers windows every layer, whatever max_window_layers says.
    path = build_tiny_checkpoint("Qwen3MoeForCausalLM", tmp_path / "moe", use_sliding_window=True, sliding_window=32,
                                 max_window_layers=2)
    with pytest.raises(ValueError, match=r"sliding_window=32 on 2 of 2 layers"):
        EngineArgs(model=path, max_model_len=64, skip_tokenizer_init=True).create_engine_config()


# ---------------------------------------------------------------------------- real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smol():
    """(our model, transformers model, tokenizer) of the embedded SmolLM2 GGUF."""
    import torch
    from transformers import AutoModelForCausalLM

    from fastdeploy.transformers_utils.model_resolver import resolve_model
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    folder, gguf = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    return load_our_model(folder, gguf), hf, get_tokenizer(folder, gguf_file=gguf)


def _chat(tok, text):
    messages = [{"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.slow
def test_smollm2_gguf_logits_match_transformers(smol):
    ours, hf, tok = smol
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. 1234")
    np.testing.assert_allclose(prefill_logits(ours, prompt, block_size=16), hf_logits(hf, prompt), atol=1e-3, rtol=0)


@pytest.mark.slow
def test_smollm2_answers_paris(smol):
    ours, _, tok = smol
    out, _ = greedy_generate(ours, _chat(tok, "What is the capital of France?"), 12, block_size=16)
    answer = tok.decode(out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_smollm2_gguf_and_converted_safetensors_agree(smol, tmp_path):
    """transformers' conversion of the GGUF to safetensors loads to the same weights as our GGUF loader."""
    ours, hf, tok = smol
    hf.config.__dict__.pop("quantization_config", None)  # a GGUF marker that does not apply to the copy
    hf.save_pretrained(tmp_path, safe_serialization=True)
    converted = load_our_model(str(tmp_path))
    ours_weights = named_weights(ours)
    converted_weights = named_weights(converted)
    assert converted_weights.keys() == ours_weights.keys()
    for name, value in converted_weights.items():
        np.testing.assert_array_equal(value, ours_weights[name], err_msg=name)
    prompt = _chat(tok, "Hi")
    np.testing.assert_array_equal(prefill_logits(converted, prompt), prefill_logits(ours, prompt))
    assert os.path.isfile(tmp_path / "config.json")
