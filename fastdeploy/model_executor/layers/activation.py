"""Activations."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy import _custom_ops as ops


class SiluAndMul(nn.Layer):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d`` (fused gate/up output)."""

    # Whether the C++ kernel runs this (decided on the first call, once the kernels are loaded).
    _use_kernel: bool | None = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self._use_kernel is None:
            object.__setattr__(self, "_use_kernel", ops.has("fd_silu_and_mul"))
        if self._use_kernel and x.dtype == paddle.float32:
            return ops.silu_and_mul(x)
        # One op: swiglu splits its single input in halves itself (about 2x faster
        # than split + silu + multiply on CPU).
        return F.swiglu(x)
