"""RMSNorm with an optional fused residual add, as in vLLM.

With the C++ kernels (``csrc/cpu/layernorm.cc``) the residual form works in place like
vLLM's ``fused_add_rms_norm``: ``forward(x, residual)`` overwrites ``residual`` with
``x + residual`` and ``x`` with the normalized sum, and returns those two tensors.
Callers must not reuse ``x`` or ``residual`` afterwards, only the returned tensors.
"""

from __future__ import annotations

import paddle

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.custom_op import CustomOp, get_op_backend
from fastdeploy.model_executor.utils import new_parameter


def rms_norm(
    x: paddle.Tensor, weight: paddle.Tensor, eps: float, residual: paddle.Tensor | None = None, fused: bool = False
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """``(norm(x + residual) * weight, x + residual)``; the second item is None without a residual.

    Normalizes over the last dimension, computing in the input dtype like transformers' fp32 path.
    ``fused``: run Paddle's fused_rms_norm (only where the platform found it has a kernel,
    :attr:`OpBackend.paddle_fused_rms_norm`).
    """
    if fused:
        from paddle.incubate.nn.functional import fused_rms_norm

        out, res = fused_rms_norm(x, weight, None, eps, x.ndim - 1, residual=residual)
        return out, (res if residual is not None else None)
    if residual is not None:
        x = x + residual
        residual = x
    out = x * paddle.rsqrt(x.pow(2).mean(axis=-1, keepdim=True) + eps) * weight
    return out, residual


class RMSNorm(CustomOp):
    """Root-mean-square norm over the last dimension.

    ``forward(x)`` returns the normalized ``x``; ``forward(x, residual)`` first adds the
    residual and returns ``(normalized, x + residual)`` in one fused kernel.
    """

    op_name = "rms_norm"

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: str = "float32") -> None:
        super().__init__(dtype)
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = new_parameter([hidden_size], dtype, fill=1.0)
        # Plain attributes: Paddle resolves parameters through Layer.__getattr__ (~1 us each).
        object.__setattr__(self, "_args", (self.weight, eps))
        object.__setattr__(self, "_paddle_fused", get_op_backend().paddle_fused_rms_norm)

    def forward_native(
        self, x: paddle.Tensor, residual: paddle.Tensor | None = None
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        out, new_residual = rms_norm(x, *self._args, residual, fused=self._paddle_fused)
        return out if residual is None else (out, new_residual)

    def forward_cpu(
        self, x: paddle.Tensor, residual: paddle.Tensor | None = None
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        if residual is None:
            return ops.rms_norm(x, *self._args)
        return ops.fused_add_rms_norm(x, residual, *self._args)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
