"""Fast access to GGUF metadata, and the cache folder of artefacts derived from a GGUF file.

``gguf.GGUFReader`` parses every field and tensor header into numpy views, which
takes ~1.7 s for SmolLM2 (mostly its 49k-entry token list). This module parses the
header with plain ``struct`` reads (~0.1 s) and leaves dequantization to
``gguf.quants``.
"""

from __future__ import annotations

import functools
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from fastdeploy import envs

_GGUF_MAGIC = b"GGUF"

# GGUF value type ids -> (struct format, numpy dtype) for the fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),  # bool
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING = 8
_ARRAY = 9


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("Unexpected end of GGUF header.")
    return struct.unpack(fmt, data)[0]


def _read_str(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    return f.read(n).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        value = _read(f, _SCALARS[vtype][0])
        return bool(value) if vtype == 7 else value
    if vtype == _STRING:
        return _read_str(f)
    if vtype == _ARRAY:
        item_type = _read(f, "<I")
        count = _read(f, "<Q")
        if item_type in _SCALARS:
            # Numeric arrays (token types, scores) are read in one go.
            dtype = np.dtype(_SCALARS[item_type][1])
            arr = np.frombuffer(f.read(dtype.itemsize * count), dtype=dtype)
            return arr.astype(bool).tolist() if item_type == 7 else arr.tolist()
        return [_read_value(f, item_type) for _ in range(count)]
    raise ValueError(f"Unknown GGUF metadata value type {vtype}.")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in a GGUF file: ``dims`` in ggml order (fastest-varying first)."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file


def _parse(path: str, with_tensors: bool) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic).")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} of {path} is too old (need 2 or later).")
        tensor_count = _read(f, "<Q")
        kv_count = _read(f, "<Q")
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _read_str(f)
            meta[key] = _read_value(f, _read(f, "<I"))
        if not with_tensors:
            return meta, []
        raw = []
        for _ in range(tensor_count):
            name = _read_str(f)
            n_dims = _read(f, "<I")
            dims = tuple(_read(f, "<Q") for _ in range(n_dims))
            raw.append((name, dims, _read(f, "<I"), _read(f, "<Q")))
        # Tensor data starts at the next multiple of the alignment after the header.
        alignment = int(meta.get("general.alignment", 32))
        data_start = -(-f.tell() // alignment) * alignment
    return meta, [GGUFTensorInfo(n, d, t, data_start + off) for n, d, t, off in raw]


@functools.lru_cache(maxsize=4)
def _read_metadata_cached(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    del size, mtime_ns  # only part of the cache key, so an edited file is read again
    return _parse(path, with_tensors=False)[0]


def read_gguf_tensor_infos(path: str) -> list[GGUFTensorInfo]:
    """Name, shape, type and file offset of every tensor of a GGUF file (header only, no data read)."""
    return _parse(path, with_tensors=True)[1]


@dataclass(frozen=True)
class GGUFBlocks:
    """A GGUF matrix kept in its block format (``--quantization gguf``).

    ``data`` is uint8 ``[rows, bytes per row]``: each row the blocks of one row of the
    Hugging Face ``[out, in]`` matrix ``shape`` (one output feature), in ggml type ``ggml_type``.
    """

    name: str  # the tensor's name in the GGUF file, for messages
    ggml_type: int
    shape: tuple[int, int]
    data: np.ndarray

    @property
    def type_name(self) -> str:
        """The ggml type's name ("Q4_1", "F16", ...)."""
        return ggml_type_name(self.ggml_type)


def ggml_type_name(ggml_type: int) -> str:
    """Name of a ggml type id ("Q4_1"), or the number for an id this gguf package does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


def row_bytes(ggml_type: int, k: int) -> int:
    """Bytes of one row of ``k`` elements stored as ``ggml_type`` blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return k // block * type_size


def _tensor_bytes(data: np.ndarray, info: GGUFTensorInfo) -> tuple[np.ndarray, tuple[int, ...]]:
    """(the tensor's bytes as ``[..., bytes per row]``, its row-major shape) from the file's bytes."""
    shape = tuple(reversed(info.dims))
    per_row = row_bytes(info.ggml_type, shape[-1])
    rows = int(np.prod(shape[:-1]))
    raw = data[info.offset : info.offset + rows * per_row]
    return raw.reshape(*shape[:-1], per_row), shape


def load_gguf_blocks(data: np.ndarray, info: GGUFTensorInfo) -> GGUFBlocks:
    """The matrix ``info`` as its raw blocks (a view of ``data``, no copy)."""
    raw, shape = _tensor_bytes(data, info)
    if len(shape) != 2:
        raise ValueError(f"GGUF tensor {info.name} has shape {shape}; only matrices stay in their blocks.")
    return GGUFBlocks(info.name, info.ggml_type, (int(shape[0]), int(shape[1])), raw)


def load_gguf_expert_blocks(data: np.ndarray, info: GGUFTensorInfo) -> list[GGUFBlocks]:
    """A stacked MoE tensor ``info`` (``ffn_*_exps``, ``[E, rows, k]``) as each expert's raw blocks (views, no copy)."""
    raw, shape = _tensor_bytes(data, info)
    if len(shape) != 3:
        raise ValueError(f"GGUF tensor {info.name} has shape {shape}; stacked experts are [experts, rows, cols].")
    return [GGUFBlocks(info.name, info.ggml_type, (int(shape[1]), int(shape[2])), raw[e]) for e in range(shape[0])]


def load_gguf_tensor(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """The tensor ``info`` from the file's bytes ``data`` (a uint8 memmap), dequantized to fp32.

    The result is shaped in row-major order (reversed ggml dims), i.e. Hugging Face's
    ``[out, in]`` for matrices.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw, shape = _tensor_bytes(data, info)  # dequantize wants rows of bytes: [..., bytes per row]
    return np.asarray(dequantize(raw, GGMLQuantizationType(info.ggml_type)), dtype=np.float32).reshape(shape)


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """Key/value metadata of a GGUF file (``general.*``, ``<arch>.*``, ``tokenizer.*``).

    The result is cached per (path, size, mtime); treat it as read-only.
    """
    st = os.stat(path)
    return _read_metadata_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def gguf_cache_dir(path: str) -> str:
    """Folder under ``FD_CACHE_ROOT`` for artefacts derived from one GGUF file (config, tokenizer).

    Keyed by the file's name, size and mtime, so a replaced file gets a fresh folder.
    """
    st = os.stat(path)
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(envs.cache_root(), "gguf", f"{stem}-{st.st_size}-{st.st_mtime_ns}")
