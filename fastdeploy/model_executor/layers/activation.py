"""Activations."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn


class SiluAndMul(nn.Layer):
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of last dimension ``2d`` (fused gate/up output)."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # One op: swiglu splits its single input in halves itself (about 2x faster
        # than split + silu + multiply on CPU).
        return F.swiglu(x)
