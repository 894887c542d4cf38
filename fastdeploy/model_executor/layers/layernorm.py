"""RMSNorm with an optional fused residual add, as in vLLM.

With the C++ kernels (``csrc/cpu/layernorm.cc``) the residual form works in place like
vLLM's ``fused_add_rms_norm``: ``forward(x, residual)`` overwrites ``residual`` with
``x + residual`` and ``x`` with the normalized sum, and returns those two tensors.
Callers must not reuse ``x`` or ``residual`` afterwards, only the returned tensors.
"""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy import _C
from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.utils import new_parameter, param_dtype

try:
    from paddle.incubate.nn.functional import fused_rms_norm as _fused_rms_norm
except ImportError:  # pragma: no cover - older Paddle builds
    _fused_rms_norm = None


def _probe_fused() -> bool:
    """Whether fused_rms_norm has a kernel here (F.rms_norm has none on CPU; fused_rms_norm does).

    Paddle's CPU kernel for it is built for AVX-512 and dies with SIGILL on an AVX2-only CPU,
    which no try/except can catch: without AVX-512 the plain ops run instead.
    """
    if _fused_rms_norm is None or not _C.cpu_has_avx512():
        return False
    try:
        x = paddle.ones([1, 4])
        _fused_rms_norm(x, paddle.ones([4]), None, 1e-6, 1)
        return True
    except Exception:  # noqa: BLE001 - a missing kernel shows up as a RuntimeError/NotFound
        return False


_HAS_FUSED = _probe_fused()


def rms_norm(
    x: paddle.Tensor, weight: paddle.Tensor, eps: float, residual: paddle.Tensor | None = None
) -> tuple[paddle.Tensor, paddle.Tensor | None]:
    """``(norm(x + residual) * weight, x + residual)``; the second item is None without a residual.

    Normalizes over the last dimension, computing in the input dtype like transformers' fp32 path.
    """
    if _HAS_FUSED:
        out, res = _fused_rms_norm(x, weight, None, eps, x.ndim - 1, residual=residual)
        return out, (res if residual is not None else None)
    if residual is not None:
        x = x + residual
        residual = x
    out = x * paddle.rsqrt(x.pow(2).mean(axis=-1, keepdim=True) + eps) * weight
    return out, residual


class RMSNorm(nn.Layer):
    """Root-mean-square norm over the last dimension.

    ``forward(x)`` returns the normalized ``x``; ``forward(x, residual)`` first adds the
    residual and returns ``(normalized, x + residual)`` in one fused kernel.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: str = "float32") -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = new_parameter([hidden_size], dtype, fill=1.0)

    # (weight, eps) once the kernel is known to apply, False when it does not, None before the first call:
    # a plain attribute, because Paddle resolves parameters through Layer.__getattr__ (~1 us each).
    _kernel_args: tuple | bool | None = None

    def forward(
        self, x: paddle.Tensor, residual: paddle.Tensor | None = None
    ) -> paddle.Tensor | tuple[paddle.Tensor, paddle.Tensor]:
        args = self._kernel_args
        if args is None:
            use = ops.has("fd_rms_norm") and param_dtype(self.weight) == "float32"
            args = (self.weight, self.variance_epsilon) if use else False
            object.__setattr__(self, "_kernel_args", args)
        if args and x.dtype == paddle.float32:
            if residual is None:
                return ops.rms_norm(x, *args)
            return ops.fused_add_rms_norm(x, residual, *args)
        out, new_residual = rms_norm(x, self.weight, self.variance_epsilon, residual)
        return out if residual is None else (out, new_residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
