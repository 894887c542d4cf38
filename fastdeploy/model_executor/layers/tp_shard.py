"""One rank's slice of a checkpoint tensor, taken before it is copied anywhere.

Checkpoint tensors arrive in Hugging Face's layout (weights ``[out, in]``, biases ``[out]``)
as numpy arrays (a memory map of a safetensors file: slicing first means a rank copies only
its rows) or as GGUF blocks (:class:`~fastdeploy.transformers_utils.gguf_utils.GGUFBlocks`,
one row of blocks per output feature). Column-parallel layers take rows (axis 0),
row-parallel ones take columns (axis 1): for GGUF those are whole blocks of the row, so a
split that cuts a block is refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


def shard_tensor(loaded: Any, axis: int, start: int, size: int, what: str) -> Any:
    """``loaded[start:start + size]`` along ``axis``; rows past the end (vocabulary padding) are zeros.

    Raises:
        ValueError: a GGUF matrix whose split along its input dimension would cut a block,
            or that would need padding rows.
    """
    from fastdeploy.transformers_utils.gguf_utils import GGUFBlocks

    if isinstance(loaded, GGUFBlocks):
        return _shard_blocks(loaded, axis, start, size, what)
    length = loaded.shape[axis]
    index = [slice(None)] * loaded.ndim
    index[axis] = slice(min(start, length), min(start + size, length))
    part = loaded[tuple(index)]
    if part.shape[axis] == size:
        return part
    pad = [(0, 0)] * loaded.ndim
    pad[axis] = (0, size - part.shape[axis])
    return np.pad(np.asarray(part), pad)


def _shard_blocks(blocks: Any, axis: int, start: int, size: int, what: str) -> Any:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rows, k = blocks.shape
    if axis == 0:
        if start + size > rows:
            raise ValueError(f"{what}: GGUF tensor {blocks.name!r} has {rows} rows, which do not split evenly over "
                             "--tensor-parallel-size (GGUF blocks cannot be padded); choose a size that divides it.")
        return dataclasses.replace(blocks, shape=(size, k), data=blocks.data[start : start + size])
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(blocks.ggml_type)]
    if start % block or size % block:
        raise ValueError(f"{what}: GGUF tensor {blocks.name!r} ({blocks.type_name}, blocks of {block}) cannot be "
                         f"split at input columns {start}..{start + size} of {k}: each rank must hold whole blocks; "
                         "use a --tensor-parallel-size that divides the dimension into multiples of the block.")
    first, count = start // block * type_size, size // block * type_size
    return dataclasses.replace(blocks, shape=(rows, size), data=blocks.data[:, first : first + count])
