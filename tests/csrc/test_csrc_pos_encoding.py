"""fd_rope_and_cache (csrc/cpu/pos_encoding.cc) against RotaryEmbedding's Paddle path and a scatter."""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.layernorm import rms_norm
from fastdeploy.model_executor.layers.rotary_embedding import RotaryEmbedding
from tests.csrc.conftest import bf16_round

H, KVH, NUM_BLOCKS, BS, MAX_POS = 4, 2, 8, 4, 64


def _reference(qkv, positions, rope, d, norm_weight):
    """Rotated q/k ``[T, H + KVH, D]`` and v ``[T, KVH, D]`` with plain Paddle ops."""
    t = qkv.shape[0]
    qk = paddle.to_tensor(qkv[:, : (H + KVH) * d].reshape(t, H + KVH, d))
    if norm_weight is not None:
        qk = rms_norm(qk, paddle.ones([d]), 1e-6)[0] * paddle.to_tensor(norm_weight)
    cos, sin = rope.get_cos_sin(paddle.to_tensor(positions))
    return rope.rotate(qk, cos, sin).numpy(), qkv[:, (H + KVH) * d :].reshape(t, KVH, d)


@pytest.mark.parametrize(
    "d,rotary_dim,neox,qk_norm",
    [(16, 16, True, False), (16, 16, False, False), (32, 16, True, False), (64, 64, True, True), (16, 8, False, True)],
)
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
def test_rope_and_cache_matches_paddle(d, rotary_dim, neox, qk_norm, cache_dtype):
    rng = np.random.default_rng(d + rotary_dim)
    rope = RotaryEmbedding(d, rotary_dim, MAX_POS, 10000.0, is_neox_style=neox)
    t = 7
    qkv = rng.standard_normal((t, (H + 2 * KVH) * d)).astype(np.float32)
    positions = rng.integers(0, MAX_POS, t).astype(np.int64)
    slots = rng.permutation(NUM_BLOCKS * BS)[:t].astype(np.int64)
    slots[3] = -1  # a padding token: rotated, not cached
    norm_weight = (1 + 0.1 * rng.standard_normal((H + KVH, d))).astype(np.float32) if qk_norm else None
    want_qk, want_v = _reference(qkv, positions, rope, d, norm_weight)

    shape = [NUM_BLOCKS, BS, KVH, d]
    k_cache, v_cache = paddle.full(shape, 7.0, cache_dtype), paddle.full(shape, 7.0, cache_dtype)
    qkv_t = paddle.to_tensor(qkv)
    ops.rope_and_cache(
        qkv_t, paddle.to_tensor(positions), rope.cos_sin_cache, k_cache, v_cache, paddle.to_tensor(slots),
        paddle.to_tensor(norm_weight) if qk_norm else None, H, neox, 1e-6,
    )  # fmt: skip
    out = qkv_t.numpy()
    got_qk = out[:, : (H + KVH) * d].reshape(t, H + KVH, d)
    np.testing.assert_allclose(got_qk, want_qk, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, (H + KVH) * d :], qkv[:, (H + KVH) * d :])  # v untouched

    k_rows = k_cache.astype("float32").numpy().reshape(-1, KVH, d)
    v_rows = v_cache.astype("float32").numpy().reshape(-1, KVH, d)
    cast = bf16_round if cache_dtype == "bfloat16" else (lambda a: a)
    keep = slots >= 0
    np.testing.assert_array_equal(k_rows[slots[keep]], cast(got_qk[keep, H:]))
    np.testing.assert_array_equal(v_rows[slots[keep]], cast(want_v[keep]))
    untouched = np.setdiff1d(np.arange(NUM_BLOCKS * BS), slots[keep])
    assert (k_rows[untouched] == 7.0).all() and (v_rows[untouched] == 7.0).all()


def test_position_outside_the_cache_is_an_error():
    rope = RotaryEmbedding(16, 16, MAX_POS, 10000.0)
    cache = paddle.zeros([NUM_BLOCKS, BS, KVH, 16])
    with pytest.raises(Exception, match="outside the rotary cache"):
        ops.rope_and_cache(
            paddle.zeros([1, (H + 2 * KVH) * 16]), paddle.to_tensor([MAX_POS], dtype="int64"), rope.cos_sin_cache,
            cache, cache.clone(), paddle.to_tensor([0], dtype="int64"), None, H, True, 1e-6,
        )  # fmt: skip
