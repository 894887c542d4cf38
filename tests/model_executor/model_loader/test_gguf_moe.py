"""GGUF files of the MoE architectures llama.cpp names (qwen3moe, qwen2moe): stacked expert tensors
(``ffn_{gate,up,down}_exps``), the router (``ffn_gate_inp``) and Qwen2-MoE's shared expert (``ffn_*_shexp``).

A tiny random transformers checkpoint is written as a GGUF file with the ``gguf`` package, in
llama.cpp's names and layouts; loading it must give the weights (and the tokens) of the checkpoint.
"""

import dataclasses

import numpy as np
import paddle
import pytest

from tests.model_executor.utils import build_tiny_checkpoint, hf_greedy, load_hf_model, load_our_model, prefill_logits

gguf = pytest.importorskip("gguf")

# Every layer sparse: llama.cpp's qwen2moe / qwen3moe have no dense layers.
_OVERRIDES = {"Qwen3MoeForCausalLM": dict(mlp_only_layers=[]), "Qwen2MoeForCausalLM": dict(decoder_sparse_step=1)}
_GGUF_ARCH = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe"}
# Hugging Face module (inside model.layers.N.) -> llama.cpp tensor (after blk.N.).
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip


def gguf_writer(path: str, gguf_arch: str, q8: bool = False):
    """A ``gguf.GGUFWriter`` whose ``add_tensor`` stores, with ``q8``, every matrix whose rows are whole
    Q8_0 blocks in Q8_0 (as ``convert_hf_to_gguf --outtype q8_0``), the rest F32; the MoE routers
    (``ffn_gate_inp``) stay F32 as the converter keeps them."""
    w = gguf.GGUFWriter(path, gguf_arch)
    add_tensor = w.add_tensor

    def add(tensor_name, value):
        if q8 and value.ndim >= 2 and value.shape[-1] % 32 == 0 and ".ffn_gate_inp" not in tensor_name:
            q8_type = gguf.GGMLQuantizationType.Q8_0
            add_tensor(tensor_name, gguf.quants.quantize(value, q8_type), raw_dtype=q8_type)
        else:
            add_tensor(tensor_name, value)

    w.add_tensor = add
    return w


def finish_gguf(w) -> None:
    """Write the header, metadata and tensors of ``w`` and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def checkpoint_tensors(folder: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors checkpoint folder, by Hugging Face name."""
    from safetensors.numpy import load_file

    from fastdeploy.model_executor.model_loader.weight_utils import safetensors_files

    tensors = {}
    for f in safetensors_files(folder):
        tensors.update(load_file(f))
    return tensors


def write_gguf(arch: str, folder: str, path: str, q8: bool = False) -> None:
    """The checkpoint in ``folder`` as a GGUF file, as llama.cpp's converter lays it out: F32, or with ``q8``
    every matrix whose rows are whole Q8_0 blocks in Q8_0 (the stacked experts included)."""
    config = load_hf_model(folder).config
    tensors = checkpoint_tensors(folder)
    w = gguf_writer(path, _GGUF_ARCH[arch], q8)
    w.add_vocab_size(config.vocab_size)
    w.add_context_length(config.max_position_embeddings)
    w.add_block_count(config.num_hidden_layers)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_expert_count(config.num_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "Qwen2MoeForCausalLM":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    else:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
    w.add_tensor("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    w.add_tensor("output_norm.weight", tensors.pop("model.norm.weight"))
    if "lm_head.weight" in tensors:
        w.add_tensor("output.weight", tensors.pop("lm_head.weight"))
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            stacked = np.stack([tensors.pop(f"{prefix}mlp.experts.{e}.{proj}.weight") for e in range(config.num_experts)])
            w.add_tensor(f"blk.{i}.ffn_{short}_exps.weight", stacked)
        for hf_name in [n for n in tensors if n.startswith(prefix)]:
            module, _, suffix = hf_name[len(prefix) :].rpartition(".")
            value = tensors.pop(hf_name)
            if module == "mlp.shared_expert_gate":
                value = value.reshape(-1)  # llama.cpp keeps the shared-expert gate as [H]
            w.add_tensor(f"blk.{i}.{_LAYER_TENSORS[module]}.{suffix}", value)
    assert not tensors, f"tensors left out of the GGUF file: {list(tensors)}"
    finish_gguf(w)


@pytest.mark.parametrize("arch", list(_GGUF_ARCH))
def test_moe_gguf_loads_the_checkpoint(arch, tmp_path):
    folder = build_tiny_checkpoint(arch, tmp_path / "hf", **_OVERRIDES[arch])
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    write_gguf(arch, folder, str(gguf_dir / "tiny.gguf"))
    ours = load_our_model(str(gguf_dir), "tiny.gguf")
    assert type(ours).__name__ == arch
    config = ours.config
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 32)
    from_safetensors = load_our_model(folder)
    prompt = list(range(40, 77))
    np.testing.assert_allclose(prefill_logits(ours, prompt), prefill_logits(from_safetensors, prompt), atol=1e-5,
                               rtol=0)
    from tests.model_executor.utils import greedy_generate

    assert greedy_generate(ours, prompt, 32)[0] == hf_greedy(load_hf_model(folder), prompt, 32)


def test_moe_gguf_serves_its_experts_in_their_blocks(tmp_path):
    """--quantization gguf: the dense matrices and the experts stay Q8_0 blocks (the router is dequantized);
    --quantization none dequantizes them all at load."""
    from fastdeploy.config import LoadConfig, ModelConfig
    from fastdeploy.model_executor.layers.fused_moe import FusedMoE, GateLinear, UnquantizedFusedMoEMethod
    from fastdeploy.model_executor.layers.quantization.gguf import GGUFFusedMoEMethod, GGUFLinearMethod
    from fastdeploy.model_executor.model_loader import get_model
    from tests.model_executor.utils import greedy_generate

    arch = "Qwen2MoeForCausalLM"
    # Q8_0 rows are 32 values: a shared expert of 64 (the default tiny one has 48).
    folder = build_tiny_checkpoint(arch, tmp_path / "hf", shared_expert_intermediate_size=64, **_OVERRIDES[arch])
    path = tmp_path / "tiny-q8_0.gguf"
    write_gguf(arch, folder, str(path), q8=True)
    model = get_model(ModelConfig(model=str(path), dtype="float32", quantization="gguf"), LoadConfig())
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant_method, GGUFLinearMethod)
    assert isinstance(layer.mlp.experts, FusedMoE)
    assert isinstance(layer.mlp.experts.quant_method, GGUFFusedMoEMethod)
    assert layer.mlp.experts.w13_qweight.dtype == paddle.uint8  # the blocks, not fp32 copies
    assert isinstance(layer.mlp.gate, GateLinear)
    assert layer.mlp._fused_shared.dtype == "gguf"  # the shared expert's blocks run inside the experts' op
    dequantized = load_our_model(str(tmp_path), path.name)
    assert isinstance(dequantized.model.layers[0].mlp.experts.quant_method, UnquantizedFusedMoEMethod)
    # The experts hold the file's blocks: dequantized, the weights of the --quantization none load.
    w13, w2 = (t.numpy() for t in layer.mlp.experts.dense_weights())
    want13, want2 = (t.numpy() for t in dequantized.model.layers[0].mlp.experts.dense_weights())
    np.testing.assert_array_equal(w13, want13)
    np.testing.assert_array_equal(w2, want2)
    prompt = list(range(40, 77))
    # Against the same file dequantized at load: what differs is the GGUF kernels' int8 activations
    # (measured: mean |diff| 0.0045, max 0.033); the greedy continuations part at a near-tie at token 7.
    got, want = prefill_logits(model, prompt), prefill_logits(dequantized, prompt)
    assert np.abs(got - want).mean() < 0.02
    assert greedy_generate(model, prompt, 6)[0] == greedy_generate(dequantized, prompt, 6)[0]


def test_experts_of_a_type_without_a_kernel_are_refused_at_start_up(monkeypatch):
    """The stacked (3-D) expert tensors stay in their blocks too: an F16 ``ffn_down_exps`` is refused by name."""
    from fastdeploy.model_executor.layers.quantization.gguf import check_tensor_types
    from fastdeploy.transformers_utils import gguf_utils
    from fastdeploy.transformers_utils.gguf_utils import GGUFTensorInfo

    q8, f16, f32 = (int(t) for t in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16,
                                     gguf.GGMLQuantizationType.F32))
    infos = [GGUFTensorInfo("blk.0.ffn_gate_exps.weight", (64, 32, 8), q8, 0),
             GGUFTensorInfo("blk.0.ffn_down_exps.weight", (32, 64, 8), f16, 0),
             GGUFTensorInfo("blk.0.ffn_gate_inp.weight", (64, 8), f32, 0)]  # the router: dequantized, allowed
    monkeypatch.setattr(gguf_utils, "read_gguf_tensor_infos", lambda path: infos)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_down_exps.weight' \(F16\) of tiny.gguf"):
        check_tensor_types("/nowhere/tiny.gguf")
    infos[1] = dataclasses.replace(infos[1], ggml_type=q8)
    check_tensor_types("/nowhere/tiny.gguf")
