"""Parameter helpers shared by the layers and models: creation and checked loading."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import paddle


class _Unfilled(paddle.nn.initializer.Initializer):
    """Leaves a parameter without storage: its memory is allocated when a value is first set."""

    def forward(self, var: paddle.Tensor, block: Any = None) -> None:
        return None


_DEFER_FILL = False


@contextlib.contextmanager
def deferred_parameters() -> Iterator[None]:
    """Parameters created inside get no storage until a value is set (``set_value``).

    For loaders that then set every parameter whole, one layer at a time (dummy weights):
    the model's full fp32 copy never exists at once.
    """
    global _DEFER_FILL
    previous, _DEFER_FILL = _DEFER_FILL, True
    try:
        yield
    finally:
        _DEFER_FILL = previous


def new_parameter(shape: list[int], dtype: str = "float32", fill: float = 0.0) -> paddle.Tensor:
    """An inference-only parameter (``stop_gradient=True``, so eager ops record no autograd graph).

    Filled with a constant: real values arrive through the weight loaders, and a
    constant fill is a memset where a random initializer would cost seconds. Inside
    :func:`deferred_parameters` it is left without storage instead.
    """
    init = _Unfilled() if _DEFER_FILL else paddle.nn.initializer.Constant(fill)
    param = paddle.create_parameter(shape=shape, dtype=dtype, default_initializer=init)
    param.stop_gradient = True
    return param


def to_tensor(array: np.ndarray | paddle.Tensor, dtype: str) -> paddle.Tensor:
    """A checkpoint array as a Paddle tensor of the parameter's dtype."""
    if isinstance(array, paddle.Tensor):
        return array.astype(dtype) if str(array.dtype).split(".")[-1] != dtype else array
    if dtype in ("float32", "float16", "float64") or np.dtype(array.dtype).kind not in "f":
        return paddle.to_tensor(np.ascontiguousarray(array, dtype=dtype))
    # numpy has no bfloat16: go through float32 and let Paddle cast.
    return paddle.to_tensor(np.ascontiguousarray(array, dtype=np.float32)).astype(dtype)


def param_dtype(param: paddle.Tensor) -> str:
    """Paddle dtype of a tensor as a plain string ("float32", "bfloat16", ...)."""
    return str(param.dtype).split(".")[-1]


def _refuse_integer_weights(param: paddle.Tensor, array: Any, name: str) -> None:
    """A ValueError for integer values headed for a floating-point parameter: a pre-quantized tensor whose method
    did not load it (cast to floats it would be garbage, silently)."""
    if not isinstance(array, (np.ndarray, paddle.Tensor)):  # e.g. fp8 bytes, which refuse their own conversion
        return
    dtype = str(array.dtype).removeprefix("paddle.")
    if ("int" in dtype or dtype == "bool") and param_dtype(param).startswith(("float", "bfloat")):
        raise ValueError(f"The checkpoint tensor {name or 'of a parameter'} holds {dtype} values where the model "
                         "expects floating-point weights: a pre-quantized checkpoint needs the --quantization "
                         "method it was made with (awq, gptq and fp8 checkpoints select theirs from config.json).")


def load_into(param: paddle.Tensor, array: Any, name: str = "") -> None:
    """Copy ``array`` into ``param`` after checking the shapes agree (and that it is not integer-quantized)."""
    shape = tuple(array.shape)
    if shape != tuple(param.shape):
        raise ValueError(
            f"Shape mismatch loading {name or 'a parameter'}: checkpoint has {shape}, model expects {tuple(param.shape)}."
        )
    _refuse_integer_weights(param, array, name)
    param.set_value(to_tensor(array, param_dtype(param)))


def load_into_slice(param: paddle.Tensor, array: Any, start: int, size: int, axis: int, name: str = "") -> None:
    """Copy ``array`` into ``param[..., start:start + size]`` along ``axis`` (fused layouts)."""
    expected = list(param.shape)
    expected[axis] = size
    if list(array.shape) != expected:
        raise ValueError(
            f"Shape mismatch loading {name or 'a parameter'}: checkpoint has {tuple(array.shape)}, "
            f"model expects {tuple(expected)} for this shard."
        )
    _refuse_integer_weights(param, array, name)
    index = [slice(None)] * len(expected)
    index[axis] = slice(start, start + size)
    param[tuple(index)] = to_tensor(array, param_dtype(param))


def check_all_loaded(params: dict[str, Any], layers: dict[str, Any], loaded: dict[str, set]) -> None:
    """Raise when a parameter got no checkpoint tensor.

    ``loaded`` maps parameter names to the shard ids written into them (None = the whole
    tensor); a fused parameter is complete once each of its owner's ``shard_ids`` (or
    ``expected_shards(leaf name)``) arrived.
    """
    missing = []
    for name in params:
        owner_name, _, leaf = name.rpartition(".")
        owner = layers.get(owner_name)
        # A layer whose parameters fill from different shards (FusedMoE's experts) says so per parameter.
        per_param = getattr(owner, "expected_shards", None)
        expected = per_param(leaf) if per_param is not None else set(getattr(owner, "shard_ids", ())) or {None}
        got = loaded.get(name, set())
        if None not in got and not expected <= got:
            missing.append(name)
    if missing:
        raise ValueError(f"Checkpoint is missing {len(missing)} model weights, e.g. {missing[:8]}.")
