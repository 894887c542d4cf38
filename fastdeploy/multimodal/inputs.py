"""What the engine request carries per image: its place among the prompt tokens, its hash, its tensors."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np


class TensorData(msgspec.Struct, array_like=True):
    """A numpy array as raw bytes, so it crosses the ZMQ boundary with msgspec."""

    dtype: str
    shape: list[int]
    data: bytes

    @classmethod
    def from_array(cls, array: np.ndarray) -> TensorData:
        array = np.ascontiguousarray(array)
        return cls(str(array.dtype), list(array.shape), array.tobytes())

    def to_array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)


class MultiModalFeatureSpec(msgspec.Struct, array_like=True):
    """One multimodal item of a prompt (vLLM's ``MultiModalFeatureSpec``).

    ``offset`` / ``length``: the run of placeholder tokens it fills; ``identifier``: its hash
    (vLLM's ``mm_hash``), which keys the encoder cache and enters the prefix-cache block hashes.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    pixel_values: TensorData
    grid_thw: list[int]


def mm_extra_keys(features: Sequence[MultiModalFeatureSpec] | None, start: int, end: int) -> tuple[str, ...]:
    """Hashes of the items whose placeholders overlap tokens ``[start, end)`` (a block's extra keys)."""
    if not features:
        return ()
    return tuple(f.identifier for f in features if f.offset < end and f.offset + f.length > start)
