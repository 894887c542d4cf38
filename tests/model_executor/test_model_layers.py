"""Building blocks against transformers' implementations: RMSNorm, RoPE (both styles, scaling), linears."""

import numpy as np
import paddle
import pytest
import torch
import transformers
from transformers.models.ernie4_5 import modeling_ernie4_5 as hf_ernie
from transformers.models.llama import modeling_llama as hf_llama

from fastdeploy.model_executor.layers.activation import SiluAndMul
from fastdeploy.model_executor.layers.layernorm import RMSNorm
from fastdeploy.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from fastdeploy.model_executor.layers.logits_processor import LogitsProcessor
from fastdeploy.model_executor.layers.rotary_embedding import get_rope
from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

rng = np.random.default_rng(0)


def randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_rms_norm_matches_transformers():
    x, r, w = randn(5, 64), randn(5, 64), 1 + 0.1 * randn(64)
    hf = hf_llama.LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.tensor(w))
        want = hf(torch.tensor(x)).numpy()
        want_res = hf(torch.tensor(x + r)).numpy()
    norm = RMSNorm(64, eps=1e-5)
    norm.weight.set_value(paddle.to_tensor(w))
    np.testing.assert_allclose(norm(paddle.to_tensor(x)).numpy(), want, atol=1e-6)
    out, res = norm(paddle.to_tensor(x), paddle.to_tensor(r))
    np.testing.assert_allclose(out.numpy(), want_res, atol=1e-6)
    np.testing.assert_array_equal(res.numpy(), x + r)


def _hf_cos_sin(rotary_cls, config, positions):
    emb = rotary_cls(config)
    dummy = torch.zeros(1, len(positions), 4)
    cos, sin = emb(dummy, torch.tensor([positions]))
    return cos, sin


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_matches_transformers(style):
    heads, kv_heads, d, positions = 3, 1, 16, [0, 1, 5, 17, 200, 1000]
    q, k = randn(len(positions), heads, d), randn(len(positions), kv_heads, d)
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if style == "neox":
        config = transformers.LlamaConfig(hidden_size=heads * d, num_attention_heads=heads, rope_parameters=params)
        cos, sin = _hf_cos_sin(hf_llama.LlamaRotaryEmbedding, config, positions)
        apply = hf_llama.apply_rotary_pos_emb
    else:
        config = transformers.Ernie4_5Config(
            hidden_size=heads * d, num_attention_heads=heads, head_dim=d, rope_parameters=params
        )
        cos, sin = _hf_cos_sin(hf_ernie.Ernie4_5RotaryEmbedding, config, positions)
        apply = hf_ernie.apply_rotary_pos_emb
    # transformers wants [batch, heads, seq, dim].
    tq, tk = torch.tensor(q).transpose(0, 1)[None], torch.tensor(k).transpose(0, 1)[None]
    want_q, want_k = (t[0].transpose(0, 1).numpy() for t in apply(tq, tk, cos, sin))

    rope = get_rope(d, 2048, rope_parameters=params, is_neox_style=style == "neox")
    pos = paddle.to_tensor(positions, dtype="int64")
    got_q, got_k = rope(
        pos, paddle.to_tensor(q.reshape(len(positions), -1)), paddle.to_tensor(k.reshape(len(positions), -1))
    )
    np.testing.assert_allclose(got_q.numpy().reshape(q.shape), want_q, atol=2e-5)
    np.testing.assert_allclose(got_k.numpy().reshape(k.shape), want_k, atol=2e-5)
    # The stacked path the models use gives the same.
    c, s = rope.get_cos_sin(pos)
    stacked = rope.rotate(paddle.to_tensor(np.concatenate([q, k], axis=1)), c, s).numpy()
    np.testing.assert_allclose(stacked[:, :heads], want_q, atol=2e-5)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        # YaRN (Qwen's form: attention factor from `factor`) and DeepSeek's (mscale / mscale_all_dim).
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
    ],
)  # fmt: skip
def test_rope_scaling_matches_transformers(params):
    d, positions = 32, [0, 3, 63, 64, 500, 2047]
    config = transformers.LlamaConfig(
        hidden_size=2 * d, num_attention_heads=2, max_position_embeddings=2048, rope_parameters=dict(params)
    )
    cos, sin = _hf_cos_sin(hf_llama.LlamaRotaryEmbedding, config, positions)
    rope = get_rope(d, 2048, rope_parameters=dict(params))
    c, s = rope.get_cos_sin(paddle.to_tensor(positions, dtype="int64"))
    np.testing.assert_allclose(c.numpy()[:, 0], cos[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(s.numpy()[:, 0], sin[0].numpy(), atol=1e-5)


def test_partial_rotary_leaves_tail_untouched():
    rope = get_rope(16, 64, base=10000.0, rotary_dim=8)
    x = randn(3, 2, 16)
    c, s = rope.get_cos_sin(paddle.to_tensor([0, 4, 9], dtype="int64"))
    out = rope.rotate(paddle.to_tensor(x), c, s).numpy()
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    assert not np.allclose(out[1:, :, :8], x[1:, :, :8])


def test_unsupported_rope_scaling_is_clear():
    with pytest.raises(NotImplementedError, match="dynamic"):
        get_rope(16, 64, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})


def test_fused_linears_load_hf_shards():
    x = randn(3, 8)
    wq, wk, wv, bq, bk, bv = randn(12, 8), randn(4, 8), randn(4, 8), randn(12), randn(4), randn(4)
    qkv = QKVParallelLinear(8, head_size=4, total_num_heads=3, total_num_kv_heads=1, bias=True)
    for shard, w, b in (("q", wq, bq), ("k", wk, bk), ("v", wv, bv)):
        qkv.weight_loader(qkv.weight, w, shard)
        qkv.weight_loader(qkv.bias, b, shard)
    want = np.concatenate([x @ wq.T + bq, x @ wk.T + bk, x @ wv.T + bv], axis=1)
    np.testing.assert_allclose(qkv(paddle.to_tensor(x)).numpy(), want, atol=1e-5)
    assert qkv.shard_ids == ("q", "k", "v")

    wg, wu = randn(6, 8), randn(6, 8)
    gate_up = MergedColumnParallelLinear(8, [6, 6])
    gate_up.weight_loader(gate_up.weight, wg, 0)
    gate_up.weight_loader(gate_up.weight, wu, 1)
    act = SiluAndMul()(gate_up(paddle.to_tensor(x))).numpy()
    g, u = x @ wg.T, x @ wu.T
    np.testing.assert_allclose(act, g / (1 + np.exp(-g)) * u, atol=1e-5)

    down = RowParallelLinear(6, 8)
    with pytest.raises(ValueError, match="Shape mismatch"):
        down.weight_loader(down.weight, randn(6, 8))
    with pytest.raises(ValueError, match="Unknown shard"):
        gate_up.weight_loader(gate_up.weight, wg, 2)


def test_embedding_and_tied_head():
    table = randn(10, 4)
    emb = VocabParallelEmbedding(10, 4)
    emb.weight_loader(emb.weight, table)
    ids = paddle.to_tensor([3, 0, 9], dtype="int64")
    np.testing.assert_array_equal(emb(ids).numpy(), table[[3, 0, 9]])
    head = ParallelLMHead(10, 4).tie_weights(emb)
    h = randn(2, 4)
    logits = LogitsProcessor(10)(head, paddle.to_tensor(h))
    assert logits.dtype == paddle.float32 and logits.shape == [2, 10]
    np.testing.assert_allclose(logits.numpy(), h @ table.T, atol=1e-5)
    # A head padded past the vocabulary is cut back.
    assert LogitsProcessor(7)(head, paddle.to_tensor(h)).shape == [2, 7]


def test_rms_norm_plain_ops_match_paddles_fused_op():
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.layers import layernorm

    x, r, w = (paddle.to_tensor(a) for a in (randn(4, 32), randn(4, 32), 1 + 0.1 * randn(32)))
    manual = layernorm.rms_norm(x, w, 1e-6, r)
    assert layernorm.rms_norm(x, w, 1e-6)[1] is None
    if not get_op_backend().paddle_fused_rms_norm:
        pytest.skip("Paddle's fused_rms_norm has no kernel on this CPU (it needs AVX-512)")
    fused = layernorm.rms_norm(x, w, 1e-6, r, fused=True)
    np.testing.assert_allclose(manual[0].numpy(), fused[0].numpy(), atol=1e-6)
    np.testing.assert_array_equal(manual[1].numpy(), fused[1].numpy())
