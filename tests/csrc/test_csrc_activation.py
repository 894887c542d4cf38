"""fd_silu_and_mul (csrc/cpu/activation.cc) against Paddle's swiglu."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from fastdeploy import _custom_ops as ops


@pytest.mark.parametrize("shape", [(1, 3072), (17, 64), (2, 3, 10)])
def test_silu_and_mul_matches_swiglu(shape):
    x = (np.random.default_rng(0).standard_normal(shape) * 6).astype(np.float32)
    x.flat[:4] = [-100.0, 100.0, 0.0, -0.0]  # saturated and zero gates
    want = F.swiglu(paddle.to_tensor(x)).numpy()
    got = ops.silu_and_mul(paddle.to_tensor(x)).numpy()
    assert got.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
