"""GGUF files of llama.cpp's ``deepseek2`` architecture onto DeepseekV2 / DeepseekV3.

A tiny random transformers checkpoint (the one of tests/model_executor/models/test_deepseek.py:
MLA, YaRN for V3, a dense first layer, routed + shared experts, V3's correction bias randomized)
is written the way llama.cpp's converter (``conversion/deepseek.py``, ``DeepseekV2Model``) writes
it: the same metadata keys, ``kv_b`` split into ``attn_k_b`` (transposed) / ``attn_v_b`` with the
MQA head sizes (current converters) or kept as ``attn_kv_b`` (older ones), experts stacked.
Loading it must give the checkpoint's weights and transformers' greedy tokens.
"""

import numpy as np
import pytest

from tests.model_executor.model_loader.test_gguf_moe import checkpoint_tensors, finish_gguf, gguf_writer
from tests.model_executor.models.test_deepseek import _randomize_correction_bias
from tests.model_executor.utils import (
    build_tiny_checkpoint,
    greedy_generate,
    hf_greedy,
    load_hf_model,
    load_our_model,
    prefill_logits,
)

gguf = pytest.importorskip("gguf")

# Hugging Face module (inside model.layers.N.) -> llama.cpp tensor (after blk.N.).
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp",
}  # fmt: skip


def write_deepseek2_gguf(folder: str, path: str, q8: bool = False, split_kv_b: bool = True,
                         fuse_gate_up: bool = False) -> None:
    """The checkpoint in ``folder`` as a deepseek2 GGUF file, as ``convert_hf_to_gguf.py`` writes it.

    ``split_kv_b``: the current converter's absorbed form (``attn_k_b`` / ``attn_v_b``,
    ``head_count_kv`` 1, ``key_length_mla``); otherwise the older one (``attn_kv_b``).
    ``fuse_gate_up``: the experts' gate and up in one ``ffn_gate_up_exps`` (``--fuse-gate-up-exps``).
    """
    c = load_hf_model(folder).config
    tensors = checkpoint_tensors(folder)
    w = gguf_writer(path, "deepseek2", q8)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = dict(c.rope_parameters)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])  # the converter's legacy 0.1
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    # DeepSeek's own configs carry scoring_func (transformers' do not): sigmoid for V3, softmax for V2.
    v3 = c.model_type == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    if split_kv_b:
        w.add_head_count_kv(1)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c.qk_rope_head_dim)

    w.add_tensor("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", tensors.pop("model.norm.weight"))
    w.add_tensor("output.weight", tensors.pop("lm_head.weight"))
    heads, nope, v_dim = c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim
    for i in range(c.num_hidden_layers):
        prefix = f"model.layers.{i}."
        if f"{prefix}mlp.experts.0.gate_proj.weight" in tensors:
            stacked = {proj: np.stack([tensors.pop(f"{prefix}mlp.experts.{e}.{proj}_proj.weight")
                                       for e in range(c.n_routed_experts)]) for proj in ("down", "gate", "up")}
            w.add_tensor(f"blk.{i}.ffn_down_exps.weight", stacked["down"])
            if fuse_gate_up:
                w.add_tensor(f"blk.{i}.ffn_gate_up_exps.weight", np.concatenate([stacked["gate"], stacked["up"]], 1))
            else:
                w.add_tensor(f"blk.{i}.ffn_gate_exps.weight", stacked["gate"])
                w.add_tensor(f"blk.{i}.ffn_up_exps.weight", stacked["up"])
        bias = tensors.pop(f"{prefix}mlp.gate.e_score_correction_bias", None)
        if bias is not None:
            w.add_tensor(f"blk.{i}.exp_probs_b.bias", bias)
        kv_b = tensors.pop(f"{prefix}self_attn.kv_b_proj.weight")
        if split_kv_b:  # the converter's view [H, nope + v, rank], split, k_b transposed
            kv_b = kv_b.reshape(heads, nope + v_dim, -1)
            w.add_tensor(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]))
        else:
            w.add_tensor(f"blk.{i}.attn_kv_b.weight", kv_b)
        for hf_name in [n for n in tensors if n.startswith(prefix)]:
            module, _, suffix = hf_name[len(prefix):].rpartition(".")
            w.add_tensor(f"blk.{i}.{_LAYER_TENSORS[module]}.{suffix}", tensors.pop(hf_name))
    assert not tensors, f"tensors left out of the GGUF file: {list(tensors)}"
    finish_gguf(w)


@pytest.fixture(scope="module", params=["DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"])
def checkpoint(request, tmp_path_factory):
    """(architecture, checkpoint folder, transformers' greedy tokens of the prompt)."""
    folder = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), num_hidden_layers=3)
    if request.param == "DeepseekV3ForCausalLM":
        _randomize_correction_bias(folder)
    return request.param, folder, hf_greedy(load_hf_model(folder), _PROMPT, 32)


_PROMPT = list(range(40, 77))


def _dequantized_checkpoint(folder, gguf_path, config, out):
    """``folder``'s config with the weights of ``gguf_path`` dequantized, as a safetensors checkpoint."""
    import shutil

    from safetensors.numpy import save_file

    from fastdeploy.model_executor.model_loader.weight_utils import gguf_weights_iterator

    out.mkdir()
    shutil.copy(f"{folder}/config.json", out / "config.json")
    save_file({name: np.ascontiguousarray(a) for name, a in gguf_weights_iterator(str(gguf_path), config)},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("layout", ["split_kv_b", "kv_b", "q8_0"])
def test_deepseek2_gguf_matches_transformers(checkpoint, layout, tmp_path):
    arch, folder, want = checkpoint
    q8 = layout == "q8_0"
    # The older converters' attn_kv_b; V2 with the fused expert gate/up of --fuse-gate-up-exps.
    write_deepseek2_gguf(folder, str(tmp_path / "tiny.gguf"), q8=q8, split_kv_b=layout != "kv_b",
                         fuse_gate_up=arch == "DeepseekV2ForCausalLM" and layout == "split_kv_b")
    ours = load_our_model(str(tmp_path), "tiny.gguf")
    assert type(ours).__name__ == arch
    c, ref = ours.config, load_hf_model(folder).config
    for field in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                  "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "num_attention_heads"):
        assert getattr(c, field) == getattr(ref, field), field
    assert c.routed_scaling_factor == pytest.approx(ref.routed_scaling_factor)
    got_rope, ref_rope = dict(c.rope_parameters), dict(ref.rope_parameters)
    assert got_rope.keys() == ref_rope.keys() and all(
        got_rope[k] == pytest.approx(ref_rope[k]) if isinstance(ref_rope[k], float) else got_rope[k] == ref_rope[k]
        for k in ref_rope)
    if q8:
        # Q8_0 rounds the weights: transformers runs the file's dequantized values (under their HF names).
        want = hf_greedy(load_hf_model(_dequantized_checkpoint(folder, tmp_path / "tiny.gguf", c, tmp_path / "deq")),
                         _PROMPT, 32)
    else:
        np.testing.assert_allclose(prefill_logits(ours, _PROMPT), prefill_logits(load_our_model(folder), _PROMPT),
                                   atol=1e-5, rtol=0)
        assert greedy_generate(ours, _PROMPT, 32)[0] == want


def test_deepseek2_metadata_variants_refused_by_name(checkpoint, tmp_path):
    from fastdeploy.transformers_utils.gguf_deepseek2 import deepseek2_hf_config
    from fastdeploy.transformers_utils.gguf_utils import read_gguf_metadata, read_gguf_tensor_infos

    _, folder, _ = checkpoint
    path = tmp_path / "tiny.gguf"
    write_deepseek2_gguf(folder, str(path))
    meta = dict(read_gguf_metadata(str(path)))
    names = {info.name for info in read_gguf_tensor_infos(str(path))}
    deepseek2_hf_config(meta, names)  # the file itself maps
    for key, value in [("nextn_predict_layers", 1), ("expert_gating_func", 3), ("rope.scaling.type", "longrope"),
                       ("attention.temperature_scale", 0.1), ("rope.scaling.yarn_ext_factor", 0.5),
                       ("expert_feed_forward_length", [32, 48, 32])]:
        with pytest.raises(ValueError, match=rf"deepseek2\.{key.replace('.', '[.]')}"):
            deepseek2_hf_config({**meta, f"deepseek2.{key}": value}, names)
    sigmoid = {**meta, "deepseek2.expert_gating_func": 2}
    with pytest.raises(ValueError, match="exp_probs_b"):
        deepseek2_hf_config(sigmoid, {n for n in names if "exp_probs_b" not in n})


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_deepseek2_gguf_serves_quantized_with_a_dense_kv_b(fuse_gate_up, tmp_path):
    """--quantization gguf (a GGUF file's default): the matrices and the experts (apart, or one
    ffn_gate_up_exps) stay Q8_0 blocks; kv_b_proj, rebuilt from the 3-D attn_k_b / attn_v_b, is dense
    (unquantized_modules), and the absorbed decode splits it."""
    from fastdeploy.config import LoadConfig, ModelConfig
    from fastdeploy.model_executor.layers.linear import UnquantizedLinearMethod
    from fastdeploy.model_executor.layers.quantization.gguf import GGUFFusedMoEMethod, GGUFLinearMethod
    from fastdeploy.model_executor.model_loader import get_model

    # q_lora_rank 64: q_b_proj's rows whole Q8_0 blocks (the kernels take no F32 matrix).
    folder = build_tiny_checkpoint("DeepseekV3ForCausalLM", tmp_path / "hf", num_hidden_layers=3, q_lora_rank=64)
    _randomize_correction_bias(folder)
    path = tmp_path / "tiny-q8_0.gguf"
    write_deepseek2_gguf(folder, str(path), q8=True, fuse_gate_up=fuse_gate_up)
    # The routers stay F32 as the converter keeps them; the start-up type check lets them through.
    from fastdeploy.model_executor.layers.quantization.gguf import check_tensor_types
    from fastdeploy.transformers_utils.gguf_utils import read_gguf_tensor_infos

    types = {info.name: info.ggml_type for info in read_gguf_tensor_infos(str(path))}
    assert types["blk.1.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    check_tensor_types(str(path))
    model = get_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf"), LoadConfig())
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_b_proj.quant_method, GGUFLinearMethod)
    assert isinstance(attn.kv_a_proj_with_mqa.quant_method, GGUFLinearMethod)
    assert isinstance(attn.kv_b_proj.quant_method, UnquantizedLinearMethod)
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts.quant_method, GGUFFusedMoEMethod)
    dequantized = load_our_model(str(tmp_path), path.name)
    # The experts' blocks, dequantized, are the weights of the --quantization none load (gate rows, then up).
    for got_w, want_w in zip(experts.dense_weights(), dequantized.model.layers[1].mlp.experts.dense_weights(),
                             strict=True):
        np.testing.assert_array_equal(got_w.numpy(), want_w.numpy())
    # Against the same file dequantized at load: what differs is the GGUF kernels' int8 activations
    # (measured: mean |diff| 0.020, 32 of 37 argmaxes equal; a flipped routing choice moves a few logits more).
    got, want = prefill_logits(model, _PROMPT), prefill_logits(dequantized, _PROMPT)
    assert np.abs(got - want).mean() < 0.03
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.8


def test_deepseek2_metadata_of_v2_lite_and_v2_files():
    """DeepSeek-V2-Lite's metadata as an older converter wrote it (no q LoRA, attn_kv_b head sizes, no gating
    key: softmax), and V2's expert groups: DeepseekV2 with its config.json's values (YaRN mscale 0.707 back)."""
    import struct

    from fastdeploy.transformers_utils.gguf_deepseek2 import deepseek2_hf_config

    f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731 - as the file stores it
    meta = {f"deepseek2.{k}": v for k, v in {
        "block_count": 27, "context_length": 163840, "embedding_length": 2048, "feed_forward_length": 10944,
        "attention.head_count": 16, "attention.head_count_kv": 16, "attention.layer_norm_rms_epsilon": f32(1e-6),
        "rope.freq_base": 10000.0, "expert_used_count": 6, "leading_dense_block_count": 1, "vocab_size": 102400,
        "attention.kv_lora_rank": 512, "attention.key_length": 192, "attention.value_length": 128,
        "expert_feed_forward_length": 1408, "expert_count": 64, "expert_shared_count": 2,
        "expert_weights_scale": 1.0, "rope.dimension_count": 64, "rope.scaling.type": "yarn",
        "rope.scaling.factor": 40.0, "rope.scaling.original_context_length": 4096,
        "rope.scaling.yarn_log_multiplier": f32(0.1 * 0.707),
    }.items()}  # fmt: skip
    names = {"token_embd.weight", "output.weight", "blk.1.ffn_gate_inp.weight"}
    c = deepseek2_hf_config(meta, names)
    assert c.architectures == ["DeepseekV2ForCausalLM"] and c.topk_method == "greedy" and not c.norm_topk_prob
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (
        None, 512, 128, 64, 128)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.first_k_dense_replace) == (64, 6, 2, 1)
    assert c.rope_parameters == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                 "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "mscale": 0.707, "mscale_all_dim": 0.707}
    v2 = deepseek2_hf_config({**meta, "deepseek2.expert_group_count": 8, "deepseek2.expert_group_used_count": 3,
                              "deepseek2.attention.q_lora_rank": 1536}, names)
    assert (v2.topk_method, v2.n_group, v2.topk_group, v2.q_lora_rank) == ("group_limited_greedy", 8, 3, 1536)
