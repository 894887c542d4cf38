"""fd_weight_only_linear (csrc/cpu/linear.cc, oneDNN weight decompression) against reference
dequantization + an fp32 matmul.

The platform's ``onednn`` integer path: bf16 activations x s8 weights (a 4-bit value as
``q - zero``) with per-channel or per-group scales. Checked: M = 1 .. 33, a column count off
oneDNN's blocks, a part-filled last int4 group (K = 320 = 2 x 128 + 64, scales per 64 rows),
a bias, and every row's result independent of the rest of the batch (bit for bit). Skipped
on CPUs without AVX512-BF16 / AMX, where the platform never picks this path.
"""

import numpy as np
import paddle
import pytest

from fastdeploy import _C
from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.quantization.int_kernels import (
    Int4Weight,
    onednn_group,
    onednn_operands,
    quantize_int4,
    quantize_int8,
)
from fastdeploy.platforms.cpu import int_kernel_paths

pytestmark = pytest.mark.skipif(
    "onednn" not in int_kernel_paths() or "fd_weight_only_linear" not in _C.load(),
    reason="oneDNN's weight-decompression matmul runs only on AVX512-BF16 / AMX CPUs with the oneDNN kernels built",
)

rng = np.random.default_rng(0)
K, N = 320, 37
ROWS = (1, 2, 3, 4, 5, 7, 16, 17, 32, 33)


def bf16(a: np.ndarray) -> np.ndarray:
    """fp32 rounded to bf16 (nearest, ties to even), as fp32."""
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32)


def weight(bits: int, k: int = K, n: int = N):
    w = rng.standard_normal((k, n)).astype(np.float32)
    return quantize_int8(w) if bits == 8 else quantize_int4(w, 128)


def linear(x, wq, bias=None):
    group = onednn_group(x.shape[-1], wq)
    q, s = onednn_operands(wq, group)
    packed = ops.weight_only_pack(paddle.to_tensor(q), group)
    b = None if bias is None else paddle.to_tensor(bias)
    return ops.weight_only_linear(paddle.to_tensor(x), packed, paddle.to_tensor(s), b, q.shape[1], group).numpy()


@pytest.mark.parametrize("bits", [8, 4])
def test_matches_dequantized_weights_times_fp32_activations(bits):
    wq = weight(bits)
    wd = wq.dequantize().astype(np.float64)
    bias = rng.standard_normal(N).astype(np.float32)
    for m in ROWS:
        x = rng.standard_normal((m, K)).astype(np.float32)
        got = linear(x, wq, bias)
        # The kernel rounds the activations and the decompressed weights (q * scale) to bf16.
        want = bf16(x).astype(np.float64) @ bf16(wd.astype(np.float32)).astype(np.float64) + bias
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max(), err_msg=f"M={m}")
        # And against the exact fp32 product: bf16's rounding only.
        exact = x.astype(np.float64) @ wd + bias
        np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max(), err_msg=f"M={m}")


@pytest.mark.parametrize("bits", [8, 4])
def test_each_row_is_independent_of_the_batch(bits):
    wq = weight(bits)
    x = rng.standard_normal((33, K)).astype(np.float32)
    together = linear(x, wq)
    alone = np.concatenate([linear(x[i : i + 1], wq) for i in range(len(x))])
    np.testing.assert_array_equal(together, alone)
    for m in (2, 5, 16):
        np.testing.assert_array_equal(linear(x[:m], wq), together[:m], err_msg=f"M={m}")


def test_part_filled_groups_split_into_pieces_with_their_group_scale():
    wq = weight(4)
    assert onednn_group(K, wq) == 64
    q, s = onednn_operands(wq, 64)
    assert s.shape == (5, N) and np.array_equal(s[[0, 1, 2, 3, 4]], wq.scales[[0, 0, 1, 1, 2]])
    g = np.arange(K) // 128
    np.testing.assert_array_equal(q.astype(np.float32) * wq.scales[g], wq.dequantize())
    # A group that shares too few rows with K is left to int_gemm.cc.
    assert onednn_group(130, Int4Weight(wq.q[:130], wq.scales[:2], wq.zeros[:2], 128)) is None


def test_checkpoint_zero_points_of_16_fit_int8():
    # GPTQ stores zero - 1: a zero point of 16 puts q - zero at -16 .. -1.
    q = rng.integers(0, 16, (256, N)).astype(np.uint8)
    wq = Int4Weight(q, rng.random((2, N)).astype(np.float32) + 0.1, np.full((2, N), 16, np.float32), 128)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    want = bf16(x).astype(np.float64) @ bf16(wq.dequantize()).astype(np.float64)
    np.testing.assert_allclose(linear(x, wq), want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_bad_operands_are_refused():
    wq = weight(8)
    q, s = onednn_operands(wq, K)
    packed = ops.weight_only_pack(paddle.to_tensor(q), K)
    x = paddle.to_tensor(rng.standard_normal((2, K)).astype(np.float32))
    with pytest.raises(Exception, match="scales must be"):
        ops.weight_only_linear(x, packed, paddle.to_tensor(s[:, :-1]), None, N, K)
    with pytest.raises(Exception, match="group must divide K"):
        ops.weight_only_pack(paddle.to_tensor(q), 100)
