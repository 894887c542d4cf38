"""DeepSeek-V3's MTP module against an fp32 reference written from the V3 report's definition.

transformers does not run MTP layers, so the test writes one into a tiny V3 checkpoint
(``model.layers.{num_hidden_layers}.*``, random) and checks our :class:`DeepSeekMTP` against

    h' = eh_proj([enorm(Emb(t)) ; hnorm(h)]),  h^1 = TRM(h'),  logits = head(shared_head.norm(h^1))

with TRM transformers' own ``DeepseekV3DecoderLayer`` (causal, full sequence) loaded with the
same tensors, and the embedding zeroed at position 0 as vLLM does.
"""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.attention.kv_cache_spec import MLAAttentionSpec
from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata
from tests.model_executor.utils import TINY_VOCAB, build_tiny_checkpoint, load_our_model, named_weights

NUM_LAYERS = 2


def _randomize(module, torch, std=0.08):
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else std * torch.randn_like(p))


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(folder, transformers config, {name: torch tensor} of the MTP module written into it)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    path = build_tiny_checkpoint("DeepseekV3ForCausalLM", tmp_path_factory.mktemp("dsv3_mtp"),
                                 num_hidden_layers=NUM_LAYERS, num_nextn_predict_layers=1)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "eager"
    torch.manual_seed(7)
    block = DeepseekV3DecoderLayer(config, layer_idx=NUM_LAYERS).eval()
    _randomize(block, torch)
    block.mlp.gate.e_score_correction_bias.copy_(0.2 * torch.randn(config.n_routed_experts))  # a buffer in HF
    target = load_file(f"{path}/model.safetensors")
    hidden = config.hidden_size
    prefix = f"model.layers.{NUM_LAYERS}."
    tensors = {}
    for k, v in block.state_dict().items():
        v = v.detach().clone()
        if k.endswith("experts.gate_up_proj"):  # transformers' in-memory stacking -> DeepSeek's per-expert names
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                tensors[f"{prefix}mlp.experts.{e}.up_proj.weight"] = v[e, inter:].contiguous()
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                tensors[f"{prefix}mlp.experts.{e}.down_proj.weight"] = v[e].contiguous()
        else:
            tensors[prefix + k] = v.contiguous()
    tensors |= {
        prefix + "enorm.weight": 1.0 + 0.1 * torch.randn(hidden),
        prefix + "hnorm.weight": 1.0 + 0.1 * torch.randn(hidden),
        prefix + "eh_proj.weight": 0.08 * torch.randn(hidden, 2 * hidden),
        prefix + "shared_head.norm.weight": 1.0 + 0.1 * torch.randn(hidden),
        # The checkpoint's copies of the shared embedding and head (DeepSeek-V3 ships them).
        prefix + "embed_tokens.weight": target["model.embed_tokens.weight"].clone(),
        prefix + "shared_head.head.weight": target["lm_head.weight"].clone(),
    }
    save_file(tensors, f"{path}/mtp.safetensors")
    return path, config, block, tensors, target


def _reference(config, block, tensors, target, input_ids, positions, prev_hidden):
    """fp32 torch: the report's MTP module over the whole sequence (causal)."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm, DeepseekV3RotaryEmbedding

    p = f"model.layers.{NUM_LAYERS}."

    def rms(name, x):
        norm = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
        norm.weight.data.copy_(tensors[p + name])
        return norm(x)

    with torch.no_grad():
        ids, pos = torch.tensor(input_ids), torch.tensor(positions)
        emb = target["model.embed_tokens.weight"][ids] * (pos != 0).float()[:, None]
        x = torch.cat([rms("enorm.weight", emb), rms("hnorm.weight", torch.tensor(prev_hidden))], dim=-1)
        x = (x @ tensors[p + "eh_proj.weight"].T)[None]
        n = len(input_ids)
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)[None, None]
        cos_sin = DeepseekV3RotaryEmbedding(config)(x, pos[None])
        out = block(x, attention_mask=mask, position_ids=pos[None], position_embeddings=cos_sin)[0]
        logits = rms("shared_head.norm.weight", out) @ target["lm_head.weight"].T
    return out.numpy(), logits.numpy()


def test_mtp_module_matches_reference(mtp_checkpoint):
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.models.deepseek_mtp import DeepSeekMTP

    path, config, block, tensors, target_tensors = mtp_checkpoint
    target = load_our_model(path)
    mtp = DeepSeekMTP.from_target(target, ModelConfig(model=path))
    # Loaded: the module's own tensors, under their checkpoint names (gate/up fused).
    weights = named_weights(mtp)
    p = f"model.layers.{NUM_LAYERS}."
    np.testing.assert_array_equal(weights[p + "eh_proj.weight"], tensors[p + "eh_proj.weight"].numpy().T)
    np.testing.assert_array_equal(weights[p + "hnorm.weight"], tensors[p + "hnorm.weight"].numpy())
    gate_up = weights[p + "mlp.shared_experts.gate_up_proj.weight"]
    np.testing.assert_array_equal(gate_up[:, : gate_up.shape[1] // 2],
                                  tensors[p + "mlp.shared_experts.gate_proj.weight"].numpy().T)
    np.testing.assert_array_equal(weights[p + "mlp.gate.e_score_correction_bias"],
                                  tensors[p + "mlp.gate.e_score_correction_bias"].numpy())
    w13, _ = mtp.model.layers[str(NUM_LAYERS)].mlp.experts.dense_weights()
    np.testing.assert_array_equal(w13.numpy()[5, 32:], tensors[p + "mlp.experts.5.up_proj.weight"].numpy())
    # Shared, not copied: no embedding or head of its own.
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in weights)
    assert mtp.get_kv_cache_spec() == [MLAAttentionSpec(1, 48, "float32")]

    rng = np.random.default_rng(0)
    n, extra, block_size = 9, 3, 4
    ids = rng.integers(3, TINY_VOCAB, n + extra).tolist()
    prev = rng.standard_normal((n + extra, config.hidden_size)).astype(np.float32)
    positions = np.arange(n + extra)
    ref_hidden, ref_logits = _reference(config, block, tensors, target_tensors, ids, positions.tolist(), prev)

    blocks = np.random.default_rng(1).permutation(8)[None, :].astype(np.int64)
    cache = [spec.allocate(8, block_size, zero=True) for spec in mtp.get_kv_cache_spec()]
    # One prefill of n tokens, then decodes one token at a time (the absorbed path).
    steps = [(0, n)] + [(n + i, 1) for i in range(extra)]
    for start, q in steps:
        md, pos = build_attention_metadata(blocks, np.array([q]), np.array([start + q]), block_size)
        with paddle.no_grad():
            hidden = mtp(paddle.to_tensor(np.asarray(ids[start : start + q], np.int64)), paddle.to_tensor(pos),
                         paddle.to_tensor(prev[start : start + q]), cache, md)
            logits = mtp.compute_logits(hidden).numpy()
        np.testing.assert_allclose(hidden.numpy(), ref_hidden[start : start + q], atol=1e-4, rtol=0)
        np.testing.assert_allclose(logits, ref_logits[start : start + q], atol=1e-4, rtol=0)


def test_target_skips_mtp_tensors_and_mtp_needs_them(mtp_checkpoint, tmp_path):
    from fastdeploy.model_executor.models.deepseek_mtp import DeepSeekMTP

    path, config, *_ = mtp_checkpoint
    target = load_our_model(path)  # the MTP tensors in the folder are not the target's
    assert not any(n.startswith(f"model.layers.{NUM_LAYERS}.") for n in dict(target.named_parameters()))
    target.config.num_nextn_predict_layers = 0
    try:
        with pytest.raises(ValueError, match="num_nextn_predict_layers"):
            DeepSeekMTP(target)
    finally:
        target.config.num_nextn_predict_layers = 1


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "wint8")])
def test_mtp_modules_are_converted_like_the_target(mtp_checkpoint, dtype, quantization):
    """The modules' experts are packed for the MoE kernel and their projections get the target's --quantization."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.model_loader import get_model
    from fastdeploy.model_executor.models.deepseek_mtp import DeepSeekMTP

    if not get_op_backend().decoder_layer:
        pytest.skip("the C++ kernels are not built here")
    model_config = ModelConfig(model=mtp_checkpoint[0], dtype=dtype, quantization=quantization)
    target = get_model(model_config)
    mtp = DeepSeekMTP.from_target(target, model_config)
    ours, theirs = mtp.model.layers[str(NUM_LAYERS)].mlp, target.model.layers[NUM_LAYERS - 1].mlp
    assert ours.experts.is_packed == theirs.experts.is_packed == (dtype == "bfloat16")
    own = [type(m.quant_method).__name__ for m in (ours.experts, ours.shared_experts.gate_up_proj)]
    target_methods = [type(m.quant_method).__name__ for m in (theirs.experts, theirs.shared_experts.gate_up_proj)]
    assert own == target_methods
    if quantization:
        assert own == ["IntFusedMoEMethod", "IntLinearMethod"]
    # eh_proj stays unquantized (DeepSeek-V3's fp8 checkpoint stores it in bf16; vLLM leaves it so too).
    assert type(mtp.model.layers[str(NUM_LAYERS)].eh_proj.quant_method).__name__ == "UnquantizedLinearMethod"


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "wint8")])
def test_converted_mtp_decodes_as_it_prefills(mtp_checkpoint, dtype, quantization):
    """With the target's conversion (bf16 packing / wint8), the module's decode steps and one prefill of the
    whole sequence read the same converted weights: the last tokens decoded one by one give what the prefill
    gives, and both stay within the format's precision of the fp32 reference (measured: 0.5% / 0.3% of the
    logits' range)."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.model_loader import get_model
    from fastdeploy.model_executor.models.deepseek_mtp import DeepSeekMTP

    if not get_op_backend().decoder_layer:
        pytest.skip("the C++ kernels are not built here")
    path, config, block, tensors, target_tensors = mtp_checkpoint
    model_config = ModelConfig(model=path, dtype=dtype, quantization=quantization)
    mtp = DeepSeekMTP.from_target(get_model(model_config), model_config)
    rng = np.random.default_rng(3)
    n, extra, block_size = 7, 4, 4
    ids = rng.integers(3, TINY_VOCAB, n + extra).tolist()
    prev = rng.standard_normal((n + extra, config.hidden_size)).astype(np.float32)
    _, ref_logits = _reference(config, block, tensors, target_tensors, ids, list(range(n + extra)), prev)
    blocks = np.arange(8, dtype=np.int64)[None, :]

    def run(steps):
        cache = [spec.allocate(8, block_size, zero=True) for spec in mtp.get_kv_cache_spec()]
        out = []
        for start, q in steps:
            md, pos = build_attention_metadata(blocks, np.array([q]), np.array([start + q]), block_size)
            with paddle.no_grad():
                hidden = mtp(paddle.to_tensor(np.asarray(ids[start : start + q], np.int64)), paddle.to_tensor(pos),
                             paddle.to_tensor(prev[start : start + q]), cache, md)
                out.append(mtp.compute_logits(hidden).astype("float32").numpy())
        return np.concatenate(out)[n:]

    prefilled = run([(0, n + extra)])
    decoded = run([(0, n)] + [(n + i, 1) for i in range(extra)])
    scale = np.abs(ref_logits[n:]).max()
    np.testing.assert_allclose(decoded, prefilled, rtol=0, atol=0.01 * scale)
    np.testing.assert_allclose(decoded, ref_logits[n:], rtol=0, atol=0.02 * scale)
    np.testing.assert_allclose(prefilled, ref_logits[n:], rtol=0, atol=0.02 * scale)
