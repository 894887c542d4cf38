"""get_model: registry, safetensors (sharded, bf16), .bin, dummy weights, GGUF name mapping."""

import os
import shutil

import numpy as np
import paddle
import pytest
import torch

from fastdeploy.config import LoadConfig, ModelConfig
from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.model_executor.model_loader.weight_utils import gguf_to_hf_name, unpermute_llama_qk
from fastdeploy.model_executor.models.registry import ModelRegistry, get_supported_archs
from tests.model_executor.utils import (
    build_tiny_checkpoint,
    load_hf_model,
    load_our_model,
    named_weights,
    prefill_logits,
)

PROMPT = [5, 17, 300, 42, 9, 777, 12]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))


def test_registry_lists_supported_architectures():
    archs = get_supported_archs()
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM"):
        assert arch in archs
    # Baidu's own checkpoints spell it with an extra underscore.
    assert ModelRegistry.resolve_model_cls(["Ernie4_5_ForCausalLM"]).__name__ == "Ernie4_5ForCausalLM"
    assert ModelRegistry.resolve_model_cls(["Nope", "Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="Supported architectures") as e:
        ModelRegistry.resolve_model_cls(["MambaForCausalLM"])
    assert "LlamaForCausalLM" in str(e.value)


def test_unknown_architecture_fails_in_get_model(tmp_path):
    build_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    config = ModelConfig(model=str(tmp_path))
    config.hf_config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="not supported"):
        get_model(config, LoadConfig())


def test_sharded_safetensors_and_bin_load_the_same(llama_dir, tmp_path):
    hf = load_hf_model(llama_dir)
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    # transformers 5 only writes safetensors: write the PyTorch checkpoint by hand.
    (tmp_path / "bin").mkdir()
    shutil.copy(os.path.join(llama_dir, "config.json"), tmp_path / "bin")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    want = prefill_logits(load_our_model(llama_dir), PROMPT)
    np.testing.assert_array_equal(prefill_logits(load_our_model(str(tmp_path / "sharded")), PROMPT), want)
    np.testing.assert_array_equal(prefill_logits(load_our_model(str(tmp_path / "bin"), load_format="pt"), PROMPT), want)


@pytest.mark.parametrize("quantization", [None, "wint8"])
def test_integer_weights_into_floating_point_parameters_are_refused(llama_dir, tmp_path, quantization):
    """A pre-quantized tensor the chosen method does not load (an int8 q_proj read as floats, also where the
    checkpoint names a format quantized at load) is a start-up error naming it, not garbage weights."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(llama_dir, tmp_path / "int8")
    file = str(tmp_path / "int8" / "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = np.clip(np.rint(tensors[name] * 100), -127, 127).astype(np.int8)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=rf"{name}: .* holds int8 values where the model expects floating-point"):
        get_model(ModelConfig(model=str(tmp_path / "int8"), quantization=quantization), LoadConfig())


def test_a_parameter_the_layer_does_not_have_is_refused_by_name(llama_dir, tmp_path):
    """A bias on a layer built without one (an option config.json does not declare, like DeepSeek-V2's mlp_bias
    before it was read) stops the load instead of being dropped with a warning."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(llama_dir, tmp_path / "bias")
    file = str(tmp_path / "bias" / "model.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.mlp.down_proj.bias"] = np.ones(tensors["model.norm.weight"].shape, np.float32)
    save_file(tensors, file)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.bias \(RowParallelLinear "
                                         r"model.layers.0.mlp.down_proj has no 'bias'\)"):
        get_model(ModelConfig(model=str(tmp_path / "bias")), LoadConfig())


def test_bf16_safetensors_are_widened_exactly(llama_dir, tmp_path):
    hf = load_hf_model(llama_dir).to(torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    ours = named_weights(load_our_model(str(tmp_path)))
    embed = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(ours["model.embed_tokens.weight"], embed)
    q = hf.model.layers[0].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(ours["model.layers.0.self_attn.qkv_proj.weight"][:, : q.shape[0]], q.T)


def test_dummy_weights_are_deterministic_and_sane(llama_dir):
    a = load_our_model(llama_dir, load_format="dummy")
    b = load_our_model(llama_dir, load_format="dummy")
    params, params_b = named_weights(a), named_weights(b)
    assert params.keys() == params_b.keys()
    for name, value in params.items():
        np.testing.assert_array_equal(value, params_b[name], err_msg=name)
    w = params["model.layers.0.mlp.gate_up_proj.weight"]
    assert 0.015 < w.std() < 0.025
    assert (params["model.norm.weight"] == 1).all()
    logits = prefill_logits(a, PROMPT)
    assert np.isfinite(logits).all() and np.abs(logits).max() < 10


def test_gguf_names_map_to_hf():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.1.attn_norm.weight") == "model.layers.1.input_layernorm.weight"
    assert gguf_to_hf_name("blk.1.ffn_norm.weight") == "model.layers.1.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.2.attn_k_norm.weight") == "model.layers.2.self_attn.k_norm.weight"
    for proj in ("gate", "up", "down"):
        assert gguf_to_hf_name(f"blk.0.ffn_{proj}.weight") == f"model.layers.0.mlp.{proj}_proj.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    # MoE: stacked experts (split per expert by the iterator), router, shared expert.
    assert gguf_to_hf_name("blk.0.ffn_gate_exps.weight") == "model.layers.0.mlp.experts.gate_proj.weight"
    assert gguf_to_hf_name("blk.4.ffn_gate_inp.weight") == "model.layers.4.mlp.gate.weight"
    assert gguf_to_hf_name("blk.4.ffn_down_shexp.weight") == "model.layers.4.mlp.shared_expert.down_proj.weight"
    with pytest.raises(ValueError, match="no known Hugging Face name"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


def _llama_cpp_permute(w, n_head):
    """What convert_hf_to_gguf does to Llama's q/k rows (rotate-half order -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head", [1, 3])
def test_unpermute_reverses_llama_cpp(n_head):
    w = np.random.default_rng(0).standard_normal((n_head * 8, 5)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_llama_qk(_llama_cpp_permute(w, n_head), n_head), w)
    b = np.arange(n_head * 8, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_llama_qk(_llama_cpp_permute(b, n_head), n_head), b)


def test_model_impl_selects_the_backend(llama_dir):
    pytest.importorskip("paddleformers")
    from fastdeploy.model_executor.models.paddleformers import PaddleFormersForCausalLM

    native = get_model(ModelConfig(model=llama_dir, model_impl="fastdeploy", dtype="float32"), LoadConfig())
    backend = get_model(ModelConfig(model=llama_dir, model_impl="paddleformers", dtype="float32"), LoadConfig())
    assert type(native) is ModelRegistry.resolve(["LlamaForCausalLM"], "auto")
    assert isinstance(backend, PaddleFormersForCausalLM)
    np.testing.assert_allclose(prefill_logits(backend, PROMPT), prefill_logits(native, PROMPT), atol=1e-5, rtol=0)


def test_params_are_inference_only(llama_dir):
    model = load_our_model(llama_dir)
    assert all(p.stop_gradient for p in model.parameters())
    assert isinstance(model, paddle.nn.Layer)
