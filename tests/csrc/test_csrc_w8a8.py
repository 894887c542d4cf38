"""The W8A8 ops (csrc/cpu/w8a8.cc, fd_w8a8_linear in csrc/cpu/linear.cc) against a numpy reference.

The reference quantizes each activation row's groups of K the way the kernel must (u8 with a
scale and zero point per token and group, round to nearest even) and sums in fp64: the integer
part is exact, so the ops must agree to fp32 rounding. Both paths (oneDNN's u8 x s8 matmul batched
over the groups and the portable C++) are checked, for 8-bit weights and the 7 bits the platform
keeps where the CPU has no VNNI, with one group, groups that fill K and a part-filled last group.
"""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.quantization.w8a8 import group_sums, quantize_int8_groups
from fastdeploy.platforms.cpu import onednn_w8a8_weight_max

rng = np.random.default_rng(0)
# N = 37 leaves oneDNN's column blocks part-filled; K = 320 is not a multiple of 64.
K, N = 320, 37
ROWS = (1, 2, 3, 5, 16, 33)
PATHS = ["onednn", "scalar"]
# One group (K), groups of 64 that fill K, and 128 / 100: a part-filled last group of 64 / 20 columns.
GROUPS = (K, 64, 128, 100)


def quantize_rows(x, group=K):
    """The kernel's per-token asymmetric quantization of each group of ``group`` columns: ``(q, scale, zero)``
    with ``x ~ scale * (q - zero)``, ``scale`` and ``zero`` repeated over their group's columns."""
    q, scales, zeros = [], [], []
    for i in range(0, x.shape[-1], group):
        part = x[..., i : i + group]
        lo = np.minimum(part.min(-1, keepdims=True), 0).astype(np.float32)
        hi = np.maximum(part.max(-1, keepdims=True), 0).astype(np.float32)
        s = ((hi - lo) / np.float32(255)).astype(np.float32)
        inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s != 0)
        z = np.clip(np.rint(-lo * inv), 0, 255)
        q.append(np.clip(np.rint(part * inv) + z, 0, 255))
        scales.append(np.broadcast_to(s, part.shape))
        zeros.append(np.broadcast_to(z, part.shape))
    return np.concatenate(q, -1), np.concatenate(scales, -1), np.concatenate(zeros, -1)


def reference(x, q, s, group, bias=0.0):
    """fp64 ``sum_g s_x * s_w * ((qx - zx) @ qw)`` over the groups of ``group`` rows of K (``s`` is ``[G, N]``)."""
    qx, sx, zx = quantize_rows(x, group)
    out = sum(((qx[:, i : i + group] - zx[:, i : i + group]) * sx[:, i : i + group]) @ q[i : i + group].astype(np.float64)
              * s[g] for g, i in enumerate(range(0, x.shape[-1], group)))
    return out + bias


def w8a8(x, q, s, path, group=K, bias=None):
    """The op for ``path`` on fp32 ``x`` and int8 weights ``q [K, N]`` with scales ``s [G, N]`` per group of K rows."""
    b = None if bias is None else paddle.to_tensor(bias)
    wsum = paddle.to_tensor(group_sums(q, group))
    if path == "onednn":
        packed = ops.w8a8_pack(paddle.to_tensor(q), paddle.to_tensor(s), wsum, group)
        return ops.w8a8_linear(paddle.to_tensor(x), packed, b, q.shape[1], group).numpy()
    return ops.w8a8_linear_portable(paddle.to_tensor(x), paddle.to_tensor(np.ascontiguousarray(q.T)),
                                    paddle.to_tensor(s), wsum, b, group).numpy()


def awkward_rows(m):
    """Gaussian rows, and where there is room: all positive, all negative, all zero, constant, one big outlier."""
    x = rng.standard_normal((m, K)).astype(np.float32)
    special = [np.abs(x[0]), -np.abs(x[0]), np.zeros(K), np.full(K, 0.37), np.where(np.arange(K) == 5, 40.0, x[0])]
    for i, row in enumerate(special[: max(0, m - 1)]):
        x[i + 1] = row
    return x


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("weight_max", [127, 63])
@pytest.mark.parametrize("path", PATHS)
def test_matches_the_reference_quantization_and_exact_sums(path, weight_max, group):
    if path == "onednn" and weight_max > onednn_w8a8_weight_max():
        pytest.skip("without VNNI oneDNN's int16 pair sums saturate on 8-bit weights: the platform keeps 7 bits")
    w = rng.standard_normal((K, N)).astype(np.float32)
    q, s = quantize_int8_groups(w, group, weight_max)
    assert s.shape == (-(-K // group), N) and np.abs(q).max() == weight_max
    bias = rng.standard_normal(N).astype(np.float32)
    for m in ROWS:
        x = awkward_rows(m)
        want = reference(x, q, s, group, bias)
        got = w8a8(x, q, s, path, group, bias)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=f"M={m}")
        np.testing.assert_allclose(w8a8(x, q, s, path, group), want - bias, rtol=1e-6,
                                   atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("group", (K, 100))
@pytest.mark.parametrize("path", PATHS)
def test_through_an_identity_weight_the_activations_round_to_within_half_a_step(path, group):
    """W = I is exact in int8 (q = 127, scale 1/127), so the op returns the dequantized activations themselves."""
    x = awkward_rows(6) * 3
    q, s = quantize_int8_groups(np.eye(K, dtype=np.float32), group)
    assert np.all(q == np.eye(K) * 127)
    got = w8a8(x, q, s, path, group)
    qx, sx, zx = quantize_rows(x, group)
    np.testing.assert_allclose(got, sx * (qx - zx), rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(got - x) <= sx / 2 * 1.0001 + 1e-7)
    # Asymmetric: a row whose values are all of one sign gets the whole 0..255 range, half the step of
    # symmetric int8 (max|x| / 127).
    assert np.isclose(sx[1, 0], np.abs(x[1, :group]).max() / 255, rtol=1e-6) and zx[1, 0] == 0
    assert np.isclose(sx[2, 0], np.abs(x[2, :group]).max() / 255, rtol=1e-6) and zx[2, 0] == 255


@pytest.mark.parametrize("path", PATHS)
def test_an_outlier_coarsens_only_its_own_group(path):
    """Row 5 has a 40 at column 5: with one scale per row every value rounds to a step of ~40/255; in groups
    of 100 only the first group does, the others keep the step of their own (Gaussian) range."""
    x = awkward_rows(6)
    q, s = quantize_int8_groups(np.eye(K, dtype=np.float32), 100)
    err = np.abs(w8a8(x, q, s, path, 100) - x)[5]
    _, sx_row, _ = quantize_rows(x[5:6], K)
    assert err[100:].max() < sx_row[0, 0] / 4  # well under the row-wide step's half
    assert err[100:].max() <= np.abs(x[5, 100:]).max() * 2 / 255 / 2 * 1.0001


@pytest.mark.parametrize("group", (K, 100))
@pytest.mark.parametrize("path", PATHS)
def test_rows_are_independent_of_the_batch(path, group):
    q, s = quantize_int8_groups(rng.standard_normal((K, N)).astype(np.float32), group)
    x = awkward_rows(17)
    together = w8a8(x, q, s, path, group)
    alone = np.concatenate([w8a8(x[i : i + 1], q, s, path, group) for i in range(len(x))])
    np.testing.assert_array_equal(together, alone)


def test_a_long_batch_in_several_row_chunks_matches_the_reference():
    """4,000 rows x N = 600 in 4 groups: more int32 sums than the op keeps per chunk of rows, so it runs in chunks
    (weights of the platform's width: 7 bits where oneDNN has no VNNI)."""
    from fastdeploy.model_executor.custom_op import get_op_backend

    n = 600
    q, s = quantize_int8_groups(rng.standard_normal((K, n)).astype(np.float32), 100, get_op_backend().w8a8_weight_max)
    x = rng.standard_normal((4000, K)).astype(np.float32)
    got = w8a8(x, q, s, "onednn", 100)
    want = reference(x, q, s, 100)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    np.testing.assert_array_equal(got[1234:1235], w8a8(x[1234:1235], q, s, "onednn", 100))


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_batch_and_a_leading_shape(path):
    q, s = quantize_int8_groups(rng.standard_normal((K, N)).astype(np.float32), 128)
    assert w8a8(np.zeros((0, K), np.float32), q, s, path, 128).shape == (0, N)
    x = rng.standard_normal((2, 3, K)).astype(np.float32)
    np.testing.assert_array_equal(w8a8(x, q, s, path, 128), w8a8(x.reshape(6, K), q, s, path, 128).reshape(2, 3, N))


def test_bad_operands_are_refused():
    q, s = quantize_int8_groups(rng.standard_normal((K, N)).astype(np.float32), 128)
    x = paddle.to_tensor(rng.standard_normal((2, K)).astype(np.float32))
    wsum = group_sums(q, 128)
    qt, st = paddle.to_tensor(q), paddle.to_tensor(s)
    packed = ops.w8a8_pack(qt, st, paddle.to_tensor(wsum), 128)
    with pytest.raises(Exception, match="wsum must have G \\* N elements"):
        ops.w8a8_pack(qt, st, paddle.to_tensor(wsum[:-1]), 128)
    with pytest.raises(Exception, match="wscale must have G \\* N elements"):  # scales of another group size
        ops.w8a8_pack(qt, st, paddle.to_tensor(wsum), 64)
    with pytest.raises(Exception, match="wsum has the wrong dtype"):
        ops.w8a8_pack(qt, st, paddle.to_tensor(wsum.astype(np.int64)), 128)
    with pytest.raises(Exception, match="the packed weight does not match"):  # K = 256: 2 groups, packed for 3
        ops.w8a8_linear(x[:, :-64], packed, None, N, 128)
    with pytest.raises(Exception, match="the packed weight does not match"):  # the buffer of another group size
        ops.w8a8_linear(x, packed, None, N, 64)
    with pytest.raises(Exception, match="group must be in 1..K"):
        ops.w8a8_linear(x, packed, None, N, 0)
    with pytest.raises(Exception, match="group must be in 1..K"):
        ops.w8a8_pack(qt, st, paddle.to_tensor(wsum), K + 1)
    with pytest.raises(Exception, match="weight must be \\[N, K\\]"):
        ops.w8a8_linear_portable(x[:, :-2], paddle.to_tensor(np.ascontiguousarray(q.T)), paddle.to_tensor(s),
                                 paddle.to_tensor(wsum), None, 128)
