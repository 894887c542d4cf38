"""The W8A8 ops (csrc/cpu/w8a8.cc, fd_w8a8_linear in csrc/cpu/linear.cc) against a numpy reference.

The reference quantizes each activation row the way the kernel must (u8 with a per-token scale
and zero point, round to nearest even) and sums in fp64: the integer part is exact, so the ops
must agree to fp32 rounding. Both paths (oneDNN's u8 x s8 matmul and the portable C++) are
checked, for 8-bit weights and the 7 bits the platform keeps where the CPU has no VNNI.
"""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.quantization.int_kernels import quantize_int8

rng = np.random.default_rng(0)
# N = 37 leaves oneDNN's column blocks part-filled; K = 320 is not a multiple of 64.
K, N = 320, 37
ROWS = (1, 2, 3, 5, 16, 33)
PATHS = ["onednn", "scalar"]


def quantize_rows(x):
    """The kernel's per-token asymmetric quantization: ``(q, scale, zero)`` with ``x ~ scale * (q - zero)``."""
    lo = np.minimum(x.min(-1, keepdims=True), 0).astype(np.float32)
    hi = np.maximum(x.max(-1, keepdims=True), 0).astype(np.float32)
    s = ((hi - lo) / np.float32(255)).astype(np.float32)
    inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)
    z = np.clip(np.rint(-lo * inv), 0, 255)
    return np.clip(np.rint(x * inv) + z, 0, 255), s, z


def w8a8(x, q, s, path, bias=None):
    """The op for ``path`` on fp32 ``x`` and int8 weights ``q [K, N]`` with column scales ``s``."""
    b = None if bias is None else paddle.to_tensor(bias)
    wsum = paddle.to_tensor(q.sum(0, dtype=np.int32))
    if path == "onednn":
        packed = ops.w8a8_pack(paddle.to_tensor(q))
        return ops.w8a8_linear(paddle.to_tensor(x), packed, paddle.to_tensor(s), wsum, b, q.shape[1]).numpy()
    return ops.w8a8_linear_portable(paddle.to_tensor(x), paddle.to_tensor(np.ascontiguousarray(q.T)),
                                    paddle.to_tensor(s), wsum, b).numpy()


def awkward_rows(m):
    """Gaussian rows, and where there is room: all positive, all negative, all zero, constant, one big outlier."""
    x = rng.standard_normal((m, K)).astype(np.float32)
    special = [np.abs(x[0]), -np.abs(x[0]), np.zeros(K), np.full(K, 0.37), np.where(np.arange(K) == 5, 40.0, x[0])]
    for i, row in enumerate(special[: max(0, m - 1)]):
        x[i + 1] = row
    return x


@pytest.mark.parametrize("weight_max", [127, 63])
@pytest.mark.parametrize("path", PATHS)
def test_matches_the_reference_quantization_and_exact_sums(path, weight_max):
    w = rng.standard_normal((K, N)).astype(np.float32)
    q, s = quantize_int8(w, weight_max)
    bias = rng.standard_normal(N).astype(np.float32)
    for m in ROWS:
        x = awkward_rows(m)
        qx, sx, zx = quantize_rows(x)
        want = ((qx - zx) @ q.astype(np.float64)) * s * sx + bias
        got = w8a8(x, q, s, path, bias)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=f"M={m}")
        np.testing.assert_allclose(w8a8(x, q, s, path), want - bias, rtol=1e-6, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("path", PATHS)
def test_through_an_identity_weight_the_activations_round_to_within_half_a_step(path):
    """W = I is exact in int8 (q = 127, scale 1/127), so the op returns the dequantized activations themselves."""
    x = awkward_rows(6) * 3
    got = w8a8(x, np.eye(K, dtype=np.int8) * np.int8(127), np.full(K, 1 / 127, np.float32), path)
    qx, sx, zx = quantize_rows(x)
    np.testing.assert_allclose(got, sx * (qx - zx), rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(got - x) <= sx / 2 * 1.0001 + 1e-7)
    # Asymmetric: a row whose values are all of one sign gets the whole 0..255 range, half the step of
    # symmetric int8 (max|x| / 127).
    assert np.isclose(sx[1, 0], np.abs(x[1]).max() / 255, rtol=1e-6) and zx[1, 0] == 0
    assert np.isclose(sx[2, 0], np.abs(x[2]).max() / 255, rtol=1e-6) and zx[2, 0] == 255


@pytest.mark.parametrize("path", PATHS)
def test_rows_are_independent_of_the_batch(path):
    q, s = quantize_int8(rng.standard_normal((K, N)).astype(np.float32))
    x = awkward_rows(17)
    together = w8a8(x, q, s, path)
    alone = np.concatenate([w8a8(x[i : i + 1], q, s, path) for i in range(len(x))])
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_batch_and_a_leading_shape(path):
    q, s = quantize_int8(rng.standard_normal((K, N)).astype(np.float32))
    assert w8a8(np.zeros((0, K), np.float32), q, s, path).shape == (0, N)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    np.testing.assert_array_equal(w8a8(x, q, s, path), w8a8(x.reshape(6, K), q, s, path).reshape(2, 3, N))


def test_bad_operands_are_refused():
    q, s = quantize_int8(rng.standard_normal((K, N)).astype(np.float32))
    x = paddle.to_tensor(rng.standard_normal((2, K)).astype(np.float32))
    packed = ops.w8a8_pack(paddle.to_tensor(q))
    wsum = q.sum(0, dtype=np.int32)
    with pytest.raises(Exception, match="wsum must have N elements"):
        ops.w8a8_linear(x, packed, paddle.to_tensor(s), paddle.to_tensor(wsum[:-1]), None, N)
    with pytest.raises(Exception, match="wsum has the wrong dtype"):
        ops.w8a8_linear(x, packed, paddle.to_tensor(s), paddle.to_tensor(wsum.astype(np.int64)), None, N)
    with pytest.raises(Exception, match="the packed weight does not match"):  # oneDNN pads K: 2 fewer still fit
        ops.w8a8_linear(x[:, :-64], packed, paddle.to_tensor(s), paddle.to_tensor(wsum), None, N)
    with pytest.raises(Exception, match="weight must be \\[N, K\\]"):
        ops.w8a8_linear_portable(x[:, :-2], paddle.to_tensor(np.ascontiguousarray(q.T)), paddle.to_tensor(s),
                                 paddle.to_tensor(wsum), None)
