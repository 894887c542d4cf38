"""fd_int_linear (csrc/cpu/int_gemm.cc) against reference dequantization + fp64 matmul.

Every path this CPU runs (FD_CPU_INT_KERNEL's names) is checked: every row-tile height and
remainder, a column count off the 16-column panel, a part-filled last int4 group, a bias, an odd
K for int8; and every row's result must not depend on the rest of the batch (bit for bit). The
avx512-bf16 path's reference takes the activations rounded to bf16, as its dot products do.
"""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.quantization.int_kernels import (
    BF16_DOT_PATHS,
    KERNEL_PATHS,
    linear_buffer,
    pack_int4,
    pack_int8,
    quantize_int4,
    quantize_int8,
    split_linear_buffer,
    unpack_int4,
    unpack_int8,
)
from fastdeploy.platforms.cpu import int_kernel_paths
from tests.csrc.conftest import bf16_round

rng = np.random.default_rng(0)
# int_gemm.cc's paths (the platform's "onednn" one is tests/csrc/test_csrc_weight_only_onednn.py's).
PATHS = [p for p in int_kernel_paths() if p in KERNEL_PATHS]
# K = 320: two full groups of 128 and a part-filled one of 64; N = 37: two panels and a remainder.
K, N = 320, 37
ROWS = (1, 2, 3, 4, 5, 7, 16, 33)


def int_linear(x, packed, bits, path, bias=None, group=128, n=N):
    b = None if bias is None else paddle.to_tensor(bias)
    buffer = paddle.to_tensor(linear_buffer(packed))
    return ops.int_linear(paddle.to_tensor(x), buffer, b, n, bits, group, KERNEL_PATHS[path]).numpy()


def activations(x, path):
    """What the path multiplies: bf16 dot products round the activations."""
    return (bf16_round(x) if path in BF16_DOT_PATHS else x).astype(np.float64)


def weights(bits, k=K, n=N, group=128):
    w = rng.standard_normal((k, n)).astype(np.float32)
    if bits == 8:
        q, s = quantize_int8(w)
        return pack_int8(q, s), q.astype(np.float64) * s
    iw = quantize_int4(w, group)
    return pack_int4(iw), iw.dequantize().astype(np.float64)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [8, 4])
def test_matches_dequantized_weights_times_the_activations(bits, path):
    # int8: an odd K (the panel's zero row pairs the last one). int4: K = 318 ends in a part-filled block
    # of 8 rows; groups of 6 rows start mid-block (the paths' whole-block loops must hand over to pairs).
    for k, group in ((K, 128), (K - 1, 128)) if bits == 8 else ((K, 128), (K - 2, 128), (K - 2, 6)):
        if path == "amx-bf16" and group % 32:  # its tiles need groups of a multiple of 32 rows (path_for_dtype)
            continue
        packed, wd = weights(bits, k, group=group)
        bias = rng.standard_normal(N).astype(np.float32)
        for m in ROWS:
            x = rng.standard_normal((m, k)).astype(np.float32)
            got = int_linear(x, packed, bits, path, bias, group=group)
            want = activations(x, path) @ wd + bias
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                       err_msg=f"K={k} group={group} M={m}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [8, 4])
def test_each_row_is_independent_of_the_batch(bits, path):
    packed, _ = weights(bits)
    x = rng.standard_normal((33, K)).astype(np.float32)
    together = int_linear(x, packed, bits, path)
    alone = np.concatenate([int_linear(x[i : i + 1], packed, bits, path) for i in range(len(x))])
    np.testing.assert_array_equal(together, alone)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [8, 4])
def test_each_column_is_independent_of_the_panels_beside_it(bits, path):
    # A few rows run several 16-column panels side by side (their own accumulators): a column's
    # result must be the same bits whether its panel is computed alone, in a group of panels or
    # as the first of a wider matrix.
    w = rng.standard_normal((K, 80)).astype(np.float32)
    for m in (1, 2, 3, 4, 5, 16):
        x = rng.standard_normal((m, K)).astype(np.float32)
        outs = {}
        for n in (16, 37, 80):
            if bits == 8:
                q, s = quantize_int8(w[:, :n])
                packed = pack_int8(q, s)
            else:
                packed = pack_int4(quantize_int4(w[:, :n], 128))
            outs[n] = int_linear(x, packed, bits, path, n=n)
        np.testing.assert_array_equal(outs[80][:, :37], outs[37], err_msg=f"M={m}")
        np.testing.assert_array_equal(outs[80][:, :16], outs[16], err_msg=f"M={m}")


def test_the_paths_agree_and_pack_unpack_round_trips():
    for bits, k in ((8, K), (8, K - 1), (4, K), (4, K - 2)):
        packed, wd = weights(bits, k)
        # bf16-exact activations: every path then multiplies the same numbers.
        x = bf16_round(rng.standard_normal((6, k)).astype(np.float32))
        outs = [int_linear(x, packed, bits, p) for p in PATHS]
        for o in outs[1:]:
            np.testing.assert_allclose(o, outs[0], rtol=0, atol=1e-5 * np.abs(outs[0]).max())
        parts = split_linear_buffer(linear_buffer(packed), bits, k, N, 128)
        assert all(np.array_equal(a, b.view(a.dtype)) for a, b in zip(parts, packed, strict=True))
        dense = unpack_int8(*parts, k, N) if bits == 8 else unpack_int4(*parts, k, N, 128)
        np.testing.assert_allclose(dense, wd, rtol=0, atol=1e-6)


def test_quantization_error_is_within_half_a_step():
    w = rng.standard_normal((K, N)).astype(np.float32)
    q, s = quantize_int8(w)
    assert np.abs(q * s - w).max() <= s.max() / 2 * 1.0001
    iw = quantize_int4(w, 128)
    g = np.arange(K) // 128
    assert iw.q.max() <= 15 and np.all(np.abs(iw.dequantize() - w) <= iw.scales[g] / 2 * 1.0001 + 1e-7)
    # A part-filled last group takes its range from its own 64 rows only.
    np.testing.assert_allclose(iw.scales[2], (w[256:].max(0).clip(0) - w[256:].min(0).clip(max=0)) / 15, rtol=1e-6)


def test_the_range_search_keeps_each_groups_least_squared_error():
    w = rng.standard_normal((K, N)).astype(np.float32)
    full, searched = quantize_int4(w, 128), quantize_int4(w, 128, (1.0, 0.9, 0.8))
    err = [np.square(q.dequantize() - w) for q in (full, searched)]
    g = np.arange(K) // 128
    per_group = [np.stack([e[g == i].sum(0) for i in range(3)]) for e in err]
    assert np.all(per_group[1] <= per_group[0] * (1 + 1e-6)) and per_group[1].sum() < 0.97 * per_group[0].sum()
    assert np.array_equal(quantize_int4(w, 128, (1.0,)).q, full.q)


def test_bad_operands_are_refused():
    packed, _ = weights(4)
    x = rng.standard_normal((2, K)).astype(np.float32)
    with pytest.raises(Exception, match="packed does not match"):  # one block of 8 rows of K fewer
        int_linear(x[:, :-8], packed, 4, "scalar")
    with pytest.raises(Exception, match="packed does not match"):  # int4's panels and scales without the mins
        ops.int_linear(paddle.to_tensor(x), paddle.to_tensor(linear_buffer(packed[:2])), None, N, 4, 128, 0)
