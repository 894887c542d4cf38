"""The MoE architectures beyond the shared model tests (test_models_vs_hf.py, test_llm_vs_hf.py):
which layers are sparse, the engine batched vs alone and over a prefix-cache hit, refusals, bf16."""

import json
import os

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.platforms import current_platform
from tests.model_executor.utils import (
    MOE_ARCHITECTURES,
    build_tiny_checkpoint,
    hf_greedy,
    load_hf_model,
    load_our_model,
    prefill_logits,
)

PROMPTS = [[5, 17, 99, 3, 250, 7], [11] * 9, list(range(40, 77)), [900, 901, 3]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, detokenize=False)
# Per architecture: which of the two layers is sparse (see tests/model_executor/utils.py's options).
SPARSE_LAYERS = {"Qwen3MoeForCausalLM": [True, False], "Qwen2MoeForCausalLM": [False, True],
                 "Ernie4_5_MoeForCausalLM": [True, True]}


@pytest.fixture(scope="module", params=MOE_ARCHITECTURES)
def moe(request, tmp_path_factory):
    """(architecture, checkpoint folder, transformers model)."""
    folder = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, load_hf_model(folder)


def _llm(folder, **kwargs):
    # A tiny token budget forces chunked prefill next to decodes; block size 4 spans many blocks.
    defaults = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20, dtype="float32")
    return LLM(folder, skip_tokenizer_init=True, **{**defaults, **kwargs})


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_sparse_layers_follow_the_config(moe):
    arch, folder, _ = moe
    model = load_our_model(folder)
    sparse = [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in model.model.layers]
    assert sparse == SPARSE_LAYERS[arch]
    # Dense layers keep the fused decoder-layer kernel where it is built; sparse ones run op by op.
    if current_platform.get_op_backend().decoder_layer:
        assert [layer._fused_args is None for layer in model.model.layers] == sparse
        # Each dense layer between sparse ones is a fused run of its own.
        assert [(stop - start, run is None) for start, stop, run in model.model._plan] == [(1, s) for s in sparse]


@pytest.mark.parametrize("layout, sparse", [
    (dict(num_hidden_layers=3, moe_layer_start_index=1, moe_layer_end_index=-1), [False, True, True]),
    (dict(num_hidden_layers=4, moe_layer_interval=2, moe_layer_end_index=-1), [False, True, False, True]),
    (dict(num_hidden_layers=3, moe_layer_end_index=1), [True, True, False]),
])
def test_ernie_moe_layer_range_and_interval(layout, sparse, tmp_path):
    """ERNIE-4.5-MoE's sparse layers from moe_layer_start_index to moe_layer_end_index (-1: the last) every
    moe_layer_interval layers (counted from 1, as transformers does); logits as transformers'."""
    from tests.model_executor.utils import hf_logits

    folder = build_tiny_checkpoint("Ernie4_5_MoeForCausalLM", tmp_path, **layout)
    model = load_our_model(folder)
    assert [isinstance(getattr(layer.mlp, "experts", None), FusedMoE) for layer in model.model.layers] == sparse
    prompt = list(range(40, 60))
    np.testing.assert_allclose(prefill_logits(model, prompt), hf_logits(load_hf_model(folder), prompt),
                               atol=1e-4, rtol=0)


def test_batched_alone_and_prefix_hit_give_transformers_tokens(moe):
    """Four prompts batched (chunked prefills beside decodes), each alone, and one over a prefix-cache hit."""
    _, folder, hf = moe
    llm = _llm(folder, enable_prefix_caching=True)
    want = [hf_greedy(hf, p, 32) for p in PROMPTS]
    assert _generate(llm, PROMPTS) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    prefix = list(range(100, 124))
    first, second = prefix + [7, 8, 9], prefix + [300, 301]
    llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, second, 32)


@pytest.mark.skipif(not current_platform.get_op_backend().uses_kernel("fused_moe"), reason="no fused MoE kernel")
def test_bfloat16_packs_the_experts_and_stays_close(moe):
    _, folder, _ = moe
    fp32, bf16 = load_our_model(folder), load_our_model(folder, dtype="bfloat16")
    experts = [m for m in bf16.sublayers() if isinstance(m, FusedMoE)]
    assert experts and all(m.is_packed and m._packed_args[-1] == "bfloat16" for m in experts)
    assert bf16.compute_dtype == "bfloat16"
    prompt = PROMPTS[2]
    np.testing.assert_allclose(prefill_logits(bf16, prompt), prefill_logits(fp32, prompt), atol=0.05, rtol=0)


def _with_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder


@pytest.mark.parametrize(("arch", "field", "value"), [
    ("Qwen3MoeForCausalLM", "hidden_act", "gelu"),
    ("Qwen2MoeForCausalLM", "hidden_act", "relu"),
    ("Ernie4_5_MoeForCausalLM", "moe_num_experts", [8, 8]),
])
def test_unsupported_moe_fields_are_refused_by_name(arch, field, value, tmp_path):
    folder = _with_config(build_tiny_checkpoint(arch, tmp_path / arch), **{field: value})
    with pytest.raises(ValueError, match=f"{arch}: {field}=.* is not supported"):
        load_our_model(folder)
