"""--quantization fp8: fp8 (e4m3) checkpoints in vLLM's Fp8Config forms, -q fp8 at load, and the refusals.

The checkpoints are a tiny transformers Llama whose projections are cast here to
``torch.float8_e4m3fn`` with a per-tensor ``weight_scale`` or block-wise ``weight_scale_inv``
(written out below, independent of the loader); the reference is transformers in fp32 on the
dequantized weights, greedy, token for token.
"""

import json
import os

import numpy as np
import pytest

from fastdeploy.model_executor.layers import quantization
from fastdeploy.model_executor.layers.quantization.fp8 import (
    Fp8Config,
    Fp8LinearMethod,
    e4m3_values,
    float_to_e4m3,
    pack_fp8,
    quantize_fp8,
    unpack_fp8,
)
from fastdeploy.model_executor.layers.quantization.int_kernels import BF16_DOT_PATHS

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPT = [3, 17, 42, 5, 99, 64, 7, 1, 250, 33]
NEW_TOKENS = 20


def to_fp8(w, scale):
    """torch's cast of ``w / scale`` to e4m3 and its dequantization (fp32)."""
    import torch

    q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, q.float() * scale


def build(tmp_path, form, dtype="F8_E4M3"):
    """(fp8 checkpoint folder, reference fp32 folder with the dequantized weights) of a tiny Llama."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.model_executor.utils import build_tiny_checkpoint

    ref_dir = build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ref")
    tensors = load_file(os.path.join(ref_dir, "model.safetensors"))
    quant = {}
    block = [48, 32]  # rows of 48 leave part-filled blocks in every projection
    for name, w in list(tensors.items()):
        if not any(f"{p}.weight" in name for p in PROJ):
            quant[name] = w
            continue
        base = name[: -len(".weight")]
        if form == "block":
            rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
            s = torch.stack([torch.stack([w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].abs().max()
                                          for j in range(cols)]) for i in range(rows)]) / 448
            full = s.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
            q, deq = to_fp8(w, full)
            quant[f"{base}.weight_scale_inv"] = s.float()
        else:
            s = w.abs().max() / 448
            q, deq = to_fp8(w, s)
            quant[f"{base}.weight_scale"] = s.reshape([]).float()
            quant[f"{base}.input_scale"] = torch.tensor(0.05)  # static activations: read, not used
        quant[name] = q if dtype == "F8_E4M3" else q.float().to(torch.float8_e5m2)
        tensors[name] = deq.contiguous()
    save_file(tensors, os.path.join(ref_dir, "model.safetensors"))
    q_dir = tmp_path / "fp8"
    q_dir.mkdir()
    save_file(quant, str(q_dir / "model.safetensors"))
    config = json.load(open(os.path.join(ref_dir, "config.json")))
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
        if form == "block" else {"quant_method": "fp8", "activation_scheme": "static"})
    json.dump(config, open(q_dir / "config.json", "w"))
    return str(q_dir), ref_dir


def test_the_codec_matches_torch():
    import torch

    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(e4m3_values(), want)
    finite = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
    np.testing.assert_array_equal(float_to_e4m3(e4m3_values()[finite]), finite)  # every code round-trips
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20000) * 100, rng.standard_normal(20000) * 0.01,
                        (e4m3_values()[:126] + e4m3_values()[1:127]) / 2]).astype(np.float32)  # ties to even
    got = float_to_e4m3(x)
    np.testing.assert_array_equal(got, torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    assert float_to_e4m3(np.array([1e6, -1e6], np.float32)).tolist() == [0x7E, 0xFE]  # saturates at +-448


def test_pack_and_unpack_round_trip():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((37, 45)).astype(np.float32)
    codes, scales = quantize_fp8(w)
    deq = unpack_fp8(pack_fp8(codes, scales[None, :]), 37, 45, 38)
    np.testing.assert_array_equal(deq, e4m3_values()[codes] * scales)
    assert np.abs(deq - w).max() <= np.abs(w).max(axis=0).max() / 16  # 3 mantissa bits


def test_fp8_is_registered_and_quantizes_the_projections_only():
    from fastdeploy.model_executor.layers.linear import RowParallelLinear
    from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead
    from fastdeploy.platforms import current_platform

    assert quantization.get_quantization_config("fp8") is Fp8Config
    assert "fp8" in current_platform.supported_quantization
    assert isinstance(RowParallelLinear(64, 8, quant_config=Fp8Config()).quant_method, Fp8LinearMethod)
    assert type(ParallelLMHead(40, 64, quant_config=Fp8Config()).quant_method).__name__ == "UnquantizedLinearMethod"
    skip = Fp8Config(True, ignored_layers=["model.layers.0.mlp"])
    assert skip.is_skipped("model.layers.0.mlp.gate_up_proj") and not skip.is_skipped("model.layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match="ignored_layers names some of the projections fused"):
        Fp8Config(True, ignored_layers=["model.layers.0.self_attn.q_proj"]).is_skipped("model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize("form", ["per-tensor", "block"])
def test_an_fp8_checkpoint_generates_what_transformers_does_on_its_dequantized_weights(tmp_path, form):
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.model_executor.model_loader import get_model
    from tests.model_executor.utils import greedy_generate, hf_greedy, load_hf_model, load_our_model

    q_dir, ref_dir = build(tmp_path, form)
    config = EngineArgs(model=q_dir, dtype="float32").create_engine_config().model_config
    assert config.quantization == "fp8"  # from config.json, as vLLM
    model = get_model(config)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight.dtype.name == "UINT8" and qkv._fp8_path not in BF16_DOT_PATHS
    dense = load_our_model(ref_dir).model.layers[0].self_attn.qkv_proj.dense_weight().numpy()
    np.testing.assert_allclose(qkv.dense_weight().numpy(), dense, rtol=1e-6, atol=1e-9)
    want = hf_greedy(load_hf_model(ref_dir), PROMPT, NEW_TOKENS)
    got, _ = greedy_generate(model, PROMPT, NEW_TOKENS)
    assert got == want


def test_an_fp8_checkpoint_in_bf16_runs_the_bf16_path(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.model_executor.model_loader import get_model
    from fastdeploy.platforms.cpu import fp8_kernel_paths
    from tests.model_executor.utils import load_our_model, prefill_logits

    q_dir, ref_dir = build(tmp_path, "block")
    model = get_model(EngineArgs(model=q_dir, dtype="bfloat16").create_engine_config().model_config)
    assert model.model.layers[1].mlp.down_proj._fp8_path == fp8_kernel_paths()[0]
    ref = prefill_logits(load_our_model(ref_dir), PROMPT)
    err = np.abs(prefill_logits(model, PROMPT) - ref).max() / (ref.max() - ref.min())
    assert err < 0.05, err


def test_q_fp8_quantizes_a_plain_checkpoint_at_load(tmp_path):
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import get_model
    from tests.model_executor.utils import build_tiny_checkpoint, greedy_generate, load_our_model, prefill_logits

    folder = build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "plain")
    model = get_model(ModelConfig(model=folder, quantization="fp8", dtype="float32"))
    proj = model.model.layers[0].mlp.gate_up_proj
    assert proj.weight is None and proj.qweight.dtype.name == "UINT8"
    ref = prefill_logits(load_our_model(folder), PROMPT)
    err = np.abs(prefill_logits(model, PROMPT) - ref).max() / (ref.max() - ref.min())
    assert 0 < err < 0.05, err
    tokens, _ = greedy_generate(model, PROMPT, 16)
    assert len(tokens) == 16


def test_unsupported_fp8_variants_are_refused_by_name(tmp_path):
    from fastdeploy.config import ModelConfig
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.model_executor.model_loader import get_model

    with pytest.raises(ValueError, match=r"fmt='e5m2' is not supported; supported: e4m3"):
        Fp8Config.from_config({"quant_method": "fp8", "fmt": "e5m2"})
    with pytest.raises(ValueError, match=r"weight_block_size=\[128, 127\] is not supported"):
        Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 127]})
    q_dir, _ = build(tmp_path / "e5m2", "per-tensor", dtype="F8_E5M2")
    with pytest.raises(ValueError, match=r"weight is fp8 e5m2; supported: e4m3"):
        get_model(EngineArgs(model=q_dir, dtype="float32").create_engine_config().model_config)
    # The loader's own guard (the engine already refuses -q none against the checkpoint's fp8).
    with pytest.raises(ValueError, match=r"only --quantization fp8 loads fp8 weights"):
        get_model(ModelConfig(model=q_dir, dtype="float32", quantization="none"))
    config_path = os.path.join(q_dir, "config.json")
    config = json.load(open(config_path))
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float",
                                                                               "strategy": "channel"}}}}
    # llm-compressor's config.json may spell the method with an underscore: the same refusal.
    for method in ("compressed-tensors", "compressed_tensors"):
        config["quantization_config"]["quant_method"] = method
        json.dump(config, open(config_path, "w"))
        with pytest.raises(ValueError, match=r"quantization='compressed-tensors' is not supported on cpu: "
                                             r"compressed-tensors checkpoints \(fp8 float-quantized per channel"):
            EngineArgs(model=q_dir).create_engine_config()


def test_without_the_kernels_fp8_is_refused():
    from fastdeploy.model_executor.custom_op import set_op_backend
    from fastdeploy.platforms.interface import OpBackend

    with set_op_backend(OpBackend()), pytest.raises(RuntimeError, match=r"needs the C\+\+ fp8 kernels"):
        Fp8Config()
