"""Numpy views of the engine's KV cache, so connectors read and write it in place."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

# numpy has no bfloat16: a bf16 cache is moved as its raw 16-bit words (both ends alike).
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "int8": np.int8,
                 "uint8": np.uint8}


def numpy_view(tensor: Any) -> np.ndarray:
    """A writable numpy array sharing a CPU tensor's memory (no copy).

    ``Tensor.numpy()`` copies and DLPack exports read-only arrays, so the view is built from
    the data pointer; it is valid as long as the tensor lives and is not reallocated.
    """
    if hasattr(tensor, "place") and not tensor.place.is_cpu_place():
        raise ValueError("KV connectors move host memory; this KV cache is on a device.")
    dtype_name = str(tensor.dtype).replace("paddle.", "")
    if dtype_name not in _NUMPY_DTYPES:
        raise ValueError(f"KV cache dtype {tensor.dtype} is not supported by the KV connectors.")
    dtype = np.dtype(_NUMPY_DTYPES[dtype_name])
    shape = tuple(int(d) for d in tensor.shape)
    size = int(np.prod(shape)) * dtype.itemsize
    buffer = (ctypes.c_char * size).from_address(tensor.data_ptr())
    return np.frombuffer(buffer, dtype=dtype).reshape(shape)


def numpy_kv_caches(kv_caches: Sequence[tuple[Any, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The model runner's ``[(K, V)] * num_layers`` paddle tensors as in-place numpy views.

    Raises:
        ValueError: the layers do not hold a K and a V (multi-head latent attention's single latent).
    """
    if any(len(layer) != 2 for layer in kv_caches):
        raise ValueError("The KV connectors (--kv-transfer-config) move separate K and V caches; this model's "
                         "multi-head latent attention keeps one latent cache per layer, which they do not "
                         "transfer yet.")
    return [(numpy_view(k), numpy_view(v)) for k, v in kv_caches]
