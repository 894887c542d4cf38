"""fd_linear / fd_linear_pack (oneDNN, csrc/cpu/linear.cc) against paddle.matmul."""

import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from fastdeploy.platforms.cpu import bf16_linear_path
from tests.csrc.conftest import bf16_round

rng = np.random.default_rng(0)


def _case(m, k, n, bias):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    return x, w, b


@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_paddle_matmul(m, bias):
    x, w, b = _case(m, 96, 80, bias)
    want = paddle.matmul(paddle.to_tensor(x), paddle.to_tensor(w)).numpy() + (b if bias else 0)
    packed = ops.linear_pack(paddle.to_tensor(w), "float32")
    got = ops.linear(paddle.to_tensor(x), packed, paddle.to_tensor(b) if bias else None, 80, "float32").numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 16, 40])
def test_bf16_is_an_fp32_accumulation_of_bf16_operands(m):
    """bf16 rounds x and W once; the products accumulate in fp32 (no bf16 rounding of the sum)."""
    x, w, b = _case(m, 128, 64, True)
    want = bf16_round(x).astype(np.float64) @ bf16_round(w).astype(np.float64) + b
    packed = ops.linear_pack(paddle.to_tensor(w), "bfloat16")
    assert packed.numel() == 128 * 64 * 2  # 2 bytes per weight
    got = ops.linear(paddle.to_tensor(x), packed, paddle.to_tensor(b), 64, "bfloat16").numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # ... and is within bf16's precision of the fp32 product.
    exact = x @ w + b
    assert np.abs(got - exact).max() < 2e-2 * np.abs(exact).max()


def test_leading_dims_and_empty_batch():
    x, w, _ = _case(6, 32, 24, False)
    packed = ops.linear_pack(paddle.to_tensor(w), "float32")
    got = ops.linear(paddle.to_tensor(x.reshape(2, 3, 32)), packed, None, 24, "float32")
    assert got.shape == [2, 3, 24]
    np.testing.assert_allclose(got.numpy().reshape(6, 24), x @ w, rtol=1e-5, atol=1e-5)
    assert ops.linear(paddle.zeros([0, 32]), packed, None, 24, "float32").shape == [0, 24]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unpack_inverts_pack(dtype):
    _, w, _ = _case(1, 64, 48, False)
    back = ops.linear_unpack(ops.linear_pack(paddle.to_tensor(w), dtype), 64, 48, dtype).numpy()
    np.testing.assert_array_equal(back, w if dtype == "float32" else bf16_round(w))


def test_mismatched_packed_weight_is_rejected():
    packed = ops.linear_pack(paddle.to_tensor(_case(1, 64, 48, False)[1]), "float32")
    with pytest.raises(Exception, match="packed weight does not match"):
        ops.linear(paddle.ones([2, 32]), packed, None, 48, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layers_pack_once_and_keep_their_output(dtype):
    """A fused linear layer gives the same output packed as with paddle.matmul, and drops its fp32 weight."""
    layer = MergedColumnParallelLinear(32, [16, 16], bias=True)
    layer.weight.set_value(paddle.to_tensor(_case(1, 32, 32, False)[1]))
    layer.bias.set_value(paddle.to_tensor(rng.standard_normal(32).astype(np.float32)))
    x = paddle.to_tensor(rng.standard_normal((5, 32)).astype(np.float32))
    want = layer(x).numpy()
    assert layer.process_weights_after_loading(dtype)
    assert layer.is_packed and layer.weight is None and "weight" not in dict(layer.named_parameters())
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(layer(x).numpy(), want, rtol=tol, atol=tol)
    assert not ReplicatedLinear(8, 8).process_weights_after_loading("float16")  # no kernel: stays unpacked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_do_not_depend_on_the_batch(dtype):
    """A row's output is bit-identical whatever M is (M = 1 included: oneDNN's one-row kernel sums K differently)."""
    x, w, b = _case(40, 1536, 64, True)
    packed = ops.linear_pack(paddle.to_tensor(w), dtype)
    bias = paddle.to_tensor(b)
    alone = ops.linear(paddle.to_tensor(x[:1]), packed, bias, 64, dtype).numpy()[0]
    for m in (2, 5, 16, 40):
        batched = ops.linear(paddle.to_tensor(x[:m]), packed, bias, 64, dtype).numpy()[0]
        np.testing.assert_array_equal(batched, alone, err_msg=f"M={m}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_tile_shape_and_a_partial_column_panel(dtype):
    """M = 1..13 covers each row-tile shape (1..6 rows, and their remainders); N = 72 ends in a
    part-filled 16-column panel; K = 1536 is the down projection's width."""
    x, w, b = _case(13, 1536, 72, True)
    packed = ops.linear_pack(paddle.to_tensor(w), dtype)
    xq, wq = (x, w) if dtype == "float32" else (bf16_round(x), bf16_round(w))
    tol = 1e-4 if dtype == "float32" else 2e-4
    for m in range(1, 14):
        got = ops.linear(paddle.to_tensor(x[:m]), packed, paddle.to_tensor(b), 72, dtype).numpy()
        want = xq[:m].astype(np.float64) @ wq.astype(np.float64) + b
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, err_msg=f"M={m}")


@pytest.mark.skipif(bf16_linear_path() != "panel", reason="a property of the panel kernel (AVX2 CPUs)")
def test_outputs_do_not_depend_on_the_thread_count():
    """Two OpenMP threads split the output columns: each element is still one K-ordered sum."""
    code = (
        "import hashlib, numpy as np, paddle\n"
        "from fastdeploy import _custom_ops as ops\n"
        "rng = np.random.default_rng(1)\n"
        "w = paddle.to_tensor(rng.standard_normal((576, 960)).astype(np.float32))\n"
        "x = paddle.to_tensor(rng.standard_normal((9, 576)).astype(np.float32))\n"
        "outs = [ops.linear(x, ops.linear_pack(w, d), None, 960, d).numpy() for d in ('float32', 'bfloat16')]\n"
        "print(' '.join(hashlib.sha256(o.tobytes()).hexdigest() for o in outs))\n"
    )
    runs = []
    for threads in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": threads},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.strip().splitlines()[-1])
    assert runs[0] == runs[1]
