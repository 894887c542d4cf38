"""--quantization awq / gptq: 4-bit checkpoints in AutoAWQ's and AutoGPTQ's layouts, chosen by config.json.

The checkpoints are a tiny transformers Llama whose projections are replaced by random 4-bit
weights packed here exactly as those tools store them (written out below, independent of the
loader's unpacking); the reference is the same model with the dequantized weights in fp32.
"""

import json
import os
import re

import numpy as np
import pytest

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ: nibble i of a word holds column AWQ_ORDER[i] of its 8
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
rng = np.random.default_rng(0)


def pack_cols(v, order=range(8)):
    """[R, C] values 0..15 -> int32 [R, C/8], word j's nibble i = column 8 j + order[i]."""
    r, c = v.shape
    words = np.zeros((r, c // 8), dtype=np.uint32)
    for j in range(c // 8):
        for i, col in enumerate(order):
            words[:, j] |= v[:, 8 * j + col].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def pack_rows(v):
    """[R, C] values 0..15 -> int32 [R/8, C], word i's nibble j = row 8 i + j (AutoGPTQ's qweight)."""
    words = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint32)
    for j in range(8):
        words |= v[j::8].astype(np.uint32) << np.uint32(4 * j)
    return words.view(np.int32)


# Checkpoint variants (build's ``variant``): GPTQModel's gptq_v2 (the zeros themselves stored), group_size -1 (per
# channel), the settings in the quantizer's own json file ("quant_config.json": AutoGPTQ's quantize_config.json or
# AutoAWQ's quant_config.json) instead of config.json, modules AWQ keeps unquantized.


def build(tmp_path, fmt, desc_act=False, variant=""):
    """(quantized checkpoint folder, reference fp32 folder) of a tiny Llama."""
    from safetensors.numpy import load_file, save_file

    from tests.model_executor.utils import build_tiny_checkpoint

    ref_dir = build_tiny_checkpoint("LlamaForCausalLM", tmp_path / "ref")
    tensors = load_file(os.path.join(ref_dir, "model.safetensors"))
    quant, orders = {}, {}
    for name, w in list(tensors.items()):
        if not any(f"{p}.weight" in name for p in PROJ):
            quant[name] = w
            continue
        out_f, in_f = w.shape
        group = in_f if variant == "per-channel" else GROUP
        groups = in_f // group
        q = rng.integers(0, 16, (in_f, out_f), dtype=np.uint8)
        zeros = rng.integers(1, 16, (groups, out_f), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, (groups, out_f)) * 0.01).astype(np.float16)
        # GPTQ with desc_act: input rows in activation order, each group a scattered set of rows; the
        # order comes from the layer input's statistics, so projections of one input (q/k/v, gate/up) share it.
        inputs = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        g_idx = orders.setdefault(inputs, (rng.permutation(in_f) // group if desc_act else np.arange(in_f) // group)
                                  .astype(np.int32))
        deq = scales.astype(np.float32)[g_idx] * (q.astype(np.float32) - zeros.astype(np.float32)[g_idx])
        tensors[name] = np.ascontiguousarray(deq.T)
        if variant == "modules_to_not_convert" and "down_proj" in name:
            quant[name] = tensors[name].astype(np.float16)  # kept as a plain (fp16) weight
            continue
        base = name[: -len(".weight")]
        quant[f"{base}.scales"] = scales
        if fmt == "awq":
            quant[f"{base}.qweight"] = pack_cols(q, AWQ_ORDER)
            quant[f"{base}.qzeros"] = pack_cols(zeros, AWQ_ORDER)
        else:
            quant[f"{base}.qweight"] = pack_rows(q)
            quant[f"{base}.qzeros"] = pack_cols(zeros if variant == "gptq_v2" else zeros - 1)  # v1 stores zero - 1
            quant[f"{base}.g_idx"] = g_idx
    save_file(tensors, os.path.join(ref_dir, "model.safetensors"))
    q_dir = tmp_path / fmt
    q_dir.mkdir()
    save_file(quant, str(q_dir / "model.safetensors"))
    config = json.load(open(os.path.join(ref_dir, "config.json")))
    group_size = -1 if variant == "per-channel" else GROUP
    settings = ({"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
                if fmt == "awq" else
                {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": False})
    if variant == "gptq_v2":
        settings["checkpoint_format"] = "gptq_v2"
    if variant == "modules_to_not_convert":
        settings["modules_to_not_convert"] = ["down_proj"]
    if variant == "quant_config.json":  # the quantizer's own file: AutoGPTQ's, or AutoAWQ's with its own keys
        if fmt == "awq":
            own = {"w_bit": 4, "q_group_size": group_size, "zero_point": True, "version": "GEMM"}
            json.dump(own, open(q_dir / "quant_config.json", "w"))
        else:
            json.dump({k: v for k, v in settings.items() if k != "quant_method"}, open(q_dir / "quantize_config.json", "w"))
    else:
        config["quantization_config"] = settings
    json.dump(config, open(q_dir / "config.json", "w"))
    return str(q_dir), ref_dir


@pytest.mark.parametrize("fmt,desc_act,variant", [("awq", False, ""), ("gptq", False, ""), ("gptq", True, ""),
                                                  ("gptq", False, "gptq_v2"), ("gptq", False, "per-channel"),
                                                  ("gptq", False, "quant_config.json"),
                                                  ("awq", False, "quant_config.json"),
                                                  ("awq", False, "modules_to_not_convert")])
def test_a_4bit_checkpoint_is_selected_by_its_config_and_matches_its_dequantization(tmp_path, fd_logs, fmt, desc_act,
                                                                                     variant):
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.model_loader import get_model
    from tests.model_executor.utils import load_our_model, prefill_logits

    q_dir, ref_dir = build(tmp_path, fmt, desc_act, variant)
    if variant == "quant_config.json":  # as in vLLM, the quantizer's own file is read for -q only
        config = EngineArgs(model=q_dir, dtype="float32", quantization=fmt.upper()).create_engine_config().model_config
    else:
        config = EngineArgs(model=q_dir, dtype="float32").create_engine_config().model_config
    assert config.quantization == fmt  # config.json's method, as in vLLM (or -q, case-insensitive)
    model = get_model(config)
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert qkv.weight is None and qkv.qweight.dtype.name == "UINT8"
    down = layer.mlp.down_proj
    unquantized = type(down.quant_method).__name__ == "UnquantizedLinearMethod"
    assert unquantized == (variant == "modules_to_not_convert")
    ref_model = load_our_model(ref_dir)
    ref_layer = ref_model.model.layers[0]
    for ours, ref, atol in ((qkv, ref_layer.self_attn.qkv_proj, 1e-6),
                            (down, ref_layer.mlp.down_proj, 1e-3 if variant == "modules_to_not_convert" else 1e-6)):
        dense = ref.dense_weight().numpy()
        if desc_act:  # our rows are sorted by group once at load
            dense = dense[ours._int_perm.numpy()]
        np.testing.assert_allclose(ours.dense_weight().numpy(), dense, rtol=0, atol=atol)
    prompt = [3, 17, 42, 5, 99, 64, 7, 1, 250, 33]
    got, want = prefill_logits(model, prompt), prefill_logits(ref_model, prompt)
    # int_gemm.cc computes in fp32; the "onednn" path rounds activations and weights to bf16.
    tol = 3e-2 if get_op_backend().int_gemm == "onednn" else 1e-4
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
    if desc_act and get_op_backend().decoder_layer:  # act-order permutes x before the matmul: no fused layer
        assert "run op by op: no weights packed for the fused kernel: qkv_proj (CheckpointInt4Method)" in fd_logs.text


@pytest.mark.parametrize("fmt,field,value,supported", [
    ("gptq", "lm_head", True, "lm_head=false"),
    ("gptq", "dynamic", {"-:.*down_proj": {}}, "no per-module overrides"),
    ("gptq", "modules_in_block_to_quantize", [["self_attn.q_proj"]], "every projection quantized"),
    ("gptq", "checkpoint_format", "marlin", "'gptq' and 'gptq_v2'"),
    ("gptq", "is_marlin_format", True, "'gptq' and 'gptq_v2'"),
    ("awq", "version", "gemv", "'gemm'"),
    ("awq", "zero_point", False, "zero_point=true"),
    ("awq", "group_size", 0, "a positive group_size, or -1"),
])
def test_checkpoint_fields_without_a_loader_are_refused_by_name(fmt, field, value, supported):
    from fastdeploy.model_executor.layers.quantization.awq_gptq import AWQConfig, GPTQConfig

    cls = AWQConfig if fmt == "awq" else GPTQConfig
    shown = "marlin" if field == "is_marlin_format" else value
    name = "checkpoint_format" if field == "is_marlin_format" else field
    with pytest.raises(ValueError, match=rf"quantization='{fmt}': {name}={re.escape(repr(shown))}.*supported: "
                                         rf".*{re.escape(supported)}"):
        cls.from_config({"bits": 4, "group_size": 128, field: value})


def test_refusals_in_the_checkpoint_config_come_at_start_up_and_tp_is_refused(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.model_executor.layers.quantization import awq_gptq

    q_dir, _ = build(tmp_path, "gptq")
    config = json.load(open(os.path.join(q_dir, "config.json")))
    config["quantization_config"]["lm_head"] = True
    json.dump(config, open(os.path.join(q_dir, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"quantization='gptq': lm_head=True .* not supported on CPU"):
        EngineArgs(model=q_dir).create_engine_config()
    # The quantizer's own file naming another method than -q.
    del config["quantization_config"]
    json.dump(config, open(os.path.join(q_dir, "config.json"), "w"))
    json.dump({"quant_method": "gptq", "bits": 4, "group_size": GROUP}, open(os.path.join(q_dir, "quant_config.json"), "w"))
    with pytest.raises(ValueError, match=r"quantization='awq': .* settings name the method 'gptq'; use --quantization gptq"):
        EngineArgs(model=q_dir, quantization="awq").create_engine_config()
    q_dir, _ = build(tmp_path / "tp", "gptq")
    with pytest.raises(ValueError, match=r"quantization='gptq' under tensor parallelism is not supported"):
        EngineArgs(model=q_dir, tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match=r"quantization='awq' under tensor parallelism is not supported"):
        awq_gptq.AWQConfig.check_tensor_parallel(2)


def test_a_mismatched_or_unknown_method_is_refused(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs

    q_dir, _ = build(tmp_path, "awq")
    with pytest.raises(ValueError, match=r"names the method 'awq', which does not match --quantization 'gptq'"):
        EngineArgs(model=q_dir, quantization="gptq").create_engine_config()
    config = json.load(open(os.path.join(q_dir, "config.json")))
    config["quantization_config"] = {"quant_method": "bitsandbytes"}
    json.dump(config, open(os.path.join(q_dir, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"names the method 'bitsandbytes', which FastDeploy does not know\. "
                                         r"Supported on cpu: awq, fp8, gguf"):
        EngineArgs(model=q_dir).create_engine_config()


def test_bits_other_than_4_are_refused():
    from fastdeploy.model_executor.layers.quantization.awq_gptq import GPTQConfig

    with pytest.raises(ValueError, match="bits=8 has no CPU kernel; supported: bits=4"):
        GPTQConfig.from_config({"bits": 8, "group_size": 128})
