"""fd_fp8_linear (csrc/cpu/fp8_gemm.cc): e4m3 weights widened in the kernel, on every path this CPU runs.

The reference decodes the codes with a table built here from the bit definition of e4m3 (sign,
4 exponent bits with bias 7, 3 mantissa bits, subnormals m * 2^-9, NaN at 0x7F / 0xFF),
independent of the package's, and multiplies in float64.
"""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.quantization.fp8 import KERNEL_PATHS, pack_fp8
from fastdeploy.model_executor.layers.quantization.int_kernels import BF16_DOT_PATHS, path_for_dtype
from fastdeploy.platforms.cpu import fp8_kernel_paths
from tests.csrc.conftest import bf16_round

PATHS = fp8_kernel_paths()
FINITE = np.array([c for c in range(256) if c & 0x7F != 0x7F], dtype=np.uint8)
rng = np.random.default_rng(0)


def e4m3(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 15, code & 7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (2.0 ** (e - 7) * (1 + m / 8) if e else 2.0**-6 * (m / 8))


TABLE = np.array([e4m3(c) for c in range(256)])


def reference(x, codes, scales, group, path):
    xs = bf16_round(x) if path in BF16_DOT_PATHS else x  # bf16 dot products round the activations
    w = TABLE[codes] * scales.astype(np.float64)[np.arange(codes.shape[0]) // group]
    return xs.astype(np.float64) @ w


def run(x, codes, scales, group, path, bias=None):
    return ops.fp8_linear(paddle.to_tensor(x), paddle.to_tensor(pack_fp8(codes, scales)),
                          None if bias is None else paddle.to_tensor(bias), codes.shape[1], group,
                          KERNEL_PATHS[path]).numpy()


def test_the_table_is_torchs_float8_e4m3fn():
    import torch

    want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(TABLE.astype(np.float32), want)


@pytest.mark.parametrize("path", PATHS)
def test_every_code_decodes_exactly(path):
    """One-hot rows pick each weight alone: every finite code, subnormals included, comes out exact."""
    k = FINITE.size  # 254
    codes = np.stack([rng.permutation(FINITE) for _ in range(19)], axis=1)  # [254, 19]: 19 columns, 2 panels
    scales = np.ones((1, 19), dtype=np.float32)
    got = run(np.eye(k, dtype=np.float32), codes, scales, 2 * (k // 2), path)
    np.testing.assert_array_equal(got, TABLE[codes].astype(np.float32))


@pytest.mark.parametrize("path", PATHS)
def test_a_nan_code_makes_its_column_nan(path):
    codes = rng.choice(FINITE, (8, 20))
    codes[3, 5], codes[6, 17] = 0x7F, 0xFF
    got = run(rng.standard_normal((3, 8)).astype(np.float32), codes, np.ones((1, 20), np.float32), 8, path)
    nan_cols = np.isnan(got).all(axis=0)
    assert nan_cols[[5, 17]].all() and not np.isnan(np.delete(got, [5, 17], axis=1)).any()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("k,n,group", [(70, 45, 70), (37, 33, 38), (96, 50, 32), (130, 17, 16)])
def test_the_kernel_matches_the_reference(path, k, n, group):
    """Per-channel (one group) and block-wise scales, odd K, N off the 16-column panels, M = 1..33."""
    path = path_for_dtype(path, "bfloat16", k, group)  # groups of 16 rows: not AMX's
    codes = rng.choice(FINITE, (k, n))
    groups = -(-k // group)
    scales = rng.uniform(0.001, 0.01, (groups, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((33, k)).astype(np.float32)
    whole = run(x, codes, scales, group, path, bias)
    want = reference(x, codes, scales, group, path) + bias
    scale = np.abs(bf16_round(x) if path in BF16_DOT_PATHS else x) @ np.abs(TABLE[codes] * scales[np.arange(k) // group])
    np.testing.assert_array_less(np.abs(whole - want), 1e-5 * scale + 1e-6)
    for m in range(1, 34):  # every tile shape; each row's result independent of the rest of the batch
        np.testing.assert_array_equal(run(x[:m], codes, scales, group, path, bias), whole[:m])


@pytest.mark.parametrize("path", PATHS)
def test_a_rows_result_is_independent_of_the_thread_count(path):
    from fastdeploy import _C

    control = _C.omp_thread_control()
    codes = rng.choice(FINITE, (64, 200))
    scales = rng.uniform(0.001, 0.01, (1, 200)).astype(np.float32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    before = control.get_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            control.set_threads(threads)
            results.append(run(x, codes, scales, 64, path))
    finally:
        control.set_threads(before)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_a_path_the_cpu_cannot_run_and_bad_sizes_are_refused():
    codes = rng.choice(FINITE, (8, 16))
    weight = paddle.to_tensor(pack_fp8(codes, np.ones((1, 16), np.float32)))
    x = paddle.ones([1, 8])
    with pytest.raises(Exception, match="the weight does not match"):  # the scales cut short
        ops.fp8_linear(x, weight[:-4], None, 16, 8, 0)
    with pytest.raises(Exception, match="the weight does not match"):  # another K
        ops.fp8_linear(paddle.ones([1, 10]), weight, None, 16, 10, 0)
    with pytest.raises(Exception, match="the weight does not match"):  # scales for groups of 2 rows
        ops.fp8_linear(x, weight, None, 16, 2, 0)
    with pytest.raises(Exception, match="cannot run kernel path 7"):
        ops.fp8_linear(x, weight, None, 16, 8, 7)
    if "amx-bf16" in PATHS:  # several groups of 16 rows: AMX's tiles take 32 at a time
        codes = rng.choice(FINITE, (64, 16))
        weight = paddle.to_tensor(pack_fp8(codes, np.ones((4, 16), np.float32)))
        with pytest.raises(Exception, match="amx-bf16 needs one group or groups of a multiple of 32 rows"):
            ops.fp8_linear(paddle.ones([1, 64]), weight, None, 16, 16, KERNEL_PATHS["amx-bf16"])
