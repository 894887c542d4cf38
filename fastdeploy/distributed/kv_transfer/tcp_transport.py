"""TCP transport: the blocks travel as raw ZMQ frames after the msgpack header.

The sender gathers each layer's selected K and V blocks into one contiguous array (the only
copy on its side) and hands the buffers to ZMQ without copying (``copy=False``); the receiver
scatters each frame straight from ZMQ's buffer into its pre-allocated blocks. This is the
path between hosts (FastDeploy's RDMA on GPUs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from fastdeploy.distributed.kv_transfer.base import PayloadTransport
from fastdeploy.distributed.kv_transfer.topology import TCP


def _noop() -> None:
    pass


class TcpTransport(PayloadTransport):
    """Array bytes as ZMQ frames (zero-copy hand-off to the socket)."""

    name = TCP

    def pack(self, sources: Sequence[np.ndarray], ids: np.ndarray | None,
             nbytes: int) -> tuple[dict[str, Any], list[Any], Callable[[], None]]:
        frames = [np.ascontiguousarray(a) if ids is None else a[ids] for a in sources]
        return {}, frames, _noop

    def unpack(self, header: dict[str, Any], frames: Sequence[zmq.Frame], shapes: Sequence[tuple[int, ...]],
               dtype: np.dtype) -> tuple[list[np.ndarray], Callable[[], None]]:
        if len(frames) != len(shapes):
            raise ValueError(f"Expected {len(shapes)} payload frames, got {len(frames)}.")
        arrays = [np.frombuffer(frame.buffer, dtype=dtype).reshape(shape) for frame, shape in zip(frames, shapes, strict=True)]
        return arrays, _noop
