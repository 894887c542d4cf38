"""vLLM's ``CustomOp``: a layer with a plain-Paddle forward and a kernel forward, one chosen when built.

The platform decides once which kernels run (:meth:`Platform.get_op_backend`); the model
loader builds the model inside :func:`set_op_backend` with that choice, and each layer reads
it in its constructor. ``set_op_backend(OpBackend())`` builds layers on plain Paddle ops
whatever the machine has: the in-process baseline of benchmarks and tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar

from paddle import nn

from fastdeploy.platforms import current_platform
from fastdeploy.platforms.interface import OpBackend

_backend_stack: list[OpBackend] = []


def get_op_backend() -> OpBackend:
    """The backend layers built now take: the innermost :func:`set_op_backend`, else the platform's."""
    return _backend_stack[-1] if _backend_stack else current_platform.get_op_backend()


@contextlib.contextmanager
def set_op_backend(backend: OpBackend) -> Iterator[OpBackend]:
    """Build the layers created inside the block on ``backend``."""
    _backend_stack.append(backend)
    try:
        yield backend
    finally:
        _backend_stack.pop()


class CustomOp(nn.Layer):
    """A layer whose forward is ``forward_native`` (plain Paddle) or ``forward_cpu`` (our kernel).

    Subclasses name their family in ``op_name`` (a field of :class:`OpBackend`) and may
    narrow :meth:`kernel_applies` (e.g. to fp32 parameters). The choice is made in the
    constructor and never revisited: the forward does no checks.
    """

    op_name: ClassVar[str]

    def __init__(self, dtype: str = "float32") -> None:
        super().__init__()
        use_kernel = get_op_backend().uses_kernel(self.op_name) and self.kernel_applies(dtype)
        # A plain attribute (Layer.__getattr__ costs ~1 us for registered members).
        object.__setattr__(self, "_forward_method", self.forward_cpu if use_kernel else self.forward_native)

    @property
    def uses_kernel(self) -> bool:
        return self._forward_method.__func__ is type(self).forward_cpu

    def kernel_applies(self, dtype: str) -> bool:
        """Whether the kernel takes this layer (the kernels compute on fp32 activations)."""
        return dtype == "float32"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward_method(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError
