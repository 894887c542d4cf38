"""fd_rms_norm / fd_fused_add_rms_norm (csrc/cpu/layernorm.cc) against the plain Paddle RMSNorm."""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.layernorm import RMSNorm, rms_norm

rng = np.random.default_rng(0)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm_matches_paddle(rows):
    x = rng.standard_normal((rows, 576)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(576)).astype(np.float32)
    want, _ = rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-5)
    got = ops.rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-5)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 300])
def test_fused_add_is_in_place_and_matches_paddle(rows):
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    r = rng.standard_normal((rows, 64)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    want, want_res = rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-6, paddle.to_tensor(r))
    xt, rt = paddle.to_tensor(x), paddle.to_tensor(r)
    out, res = ops.fused_add_rms_norm(xt, rt, paddle.to_tensor(w), 1e-6)
    assert out is xt and res is rt
    np.testing.assert_array_equal(rt.numpy(), x + r)  # the add is exact
    np.testing.assert_allclose(xt.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(res.numpy(), want_res.numpy())


def test_layer_uses_the_kernel_with_the_same_results():
    norm = RMSNorm(64, eps=1e-6)
    norm.weight.set_value(paddle.to_tensor((1 + 0.1 * rng.standard_normal(64)).astype(np.float32)))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    r = rng.standard_normal((3, 64)).astype(np.float32)
    want, want_res = rms_norm(paddle.to_tensor(x), norm.weight, 1e-6, paddle.to_tensor(r))
    out, res = norm(paddle.to_tensor(x), paddle.to_tensor(r))
    assert norm.uses_kernel  # the platform chose the kernel and the layer took it
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(res.numpy(), want_res.numpy())
