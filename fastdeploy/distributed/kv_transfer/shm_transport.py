"""Shared-memory transport between instances on one host (FastDeploy's IPC on GPUs).

The sender gathers the blocks straight into a POSIX shared-memory segment
(``multiprocessing.shared_memory``) and sends only the header (segment name, size) over
ZMQ; the receiver maps the segment and copies into its pre-allocated blocks. One copy on each
side, no socket traffic for the data. Segments are reused by the sender once the receiver
has acknowledged (creating and faulting in fresh pages each time costs more than the copy),
and unlinked when the connector closes.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import zmq

from fastdeploy.distributed.kv_transfer.base import PayloadTransport
from fastdeploy.distributed.kv_transfer.topology import SHM

_MIN_SEGMENT = 1 << 20
# Segments kept for reuse; more concurrent transfers create (and later unlink) extra ones.
_MAX_POOLED = 4


class _Attached:
    """A read-write mapping of a segment another process created, unknown to the resource tracker.

    ``SharedMemory(name=...)`` in Python < 3.13 registers the segment with the resource
    tracker as if this process owned it; processes started by multiprocessing share one
    tracker, so the receiver's registration would clash with the sender's (and a tracker
    would unlink the sender's segment when the receiver exits). Mapping it directly avoids both.
    """

    def __init__(self, name: str) -> None:
        fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()


class SharedMemoryTransport(PayloadTransport):
    """Array bytes through a shared-memory segment named in the header."""

    name = SHM

    def __init__(self) -> None:
        self._free: list[shared_memory.SharedMemory] = []
        self._all: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def _acquire(self, nbytes: int) -> shared_memory.SharedMemory:
        with self._lock:
            fitting = [s for s in self._free if s.size >= nbytes]
            if fitting:
                shm = min(fitting, key=lambda s: s.size)
                self._free.remove(shm)
                return shm
        size = max(_MIN_SEGMENT, 1 << (max(nbytes, 1) - 1).bit_length())  # power of two: reusable for similar sizes
        shm = shared_memory.SharedMemory(create=True, size=size)
        with self._lock:
            self._all[shm.name] = shm
        return shm

    def _release(self, shm: shared_memory.SharedMemory) -> None:
        with self._lock:
            if len(self._free) < _MAX_POOLED:
                self._free.append(shm)
                return
            self._all.pop(shm.name, None)
        shm.close()
        shm.unlink()

    def pack(self, sources: Sequence[np.ndarray], ids: np.ndarray | None,
             nbytes: int) -> tuple[dict[str, Any], list[Any], Callable[[], None]]:
        shm = self._acquire(nbytes)
        offset = 0
        try:
            for a in sources:
                shape = (len(ids), *a.shape[1:]) if ids is not None else a.shape
                view = np.ndarray(shape, dtype=a.dtype, buffer=shm.buf, offset=offset)
                if ids is None:
                    np.copyto(view, a)
                else:
                    # mode="clip": "raise" would gather into a temporary first (ids are checked by the caller).
                    np.take(a, ids, axis=0, out=view, mode="clip")
                offset += view.nbytes
                del view  # no export of shm.buf may outlive this (close() would fail)
        except BaseException:
            self._release(shm)
            raise
        return {"shm_name": shm.name, "shm_bytes": offset}, [], lambda: self._release(shm)

    def unpack(self, header: dict[str, Any], frames: Sequence[zmq.Frame], shapes: Sequence[tuple[int, ...]],
               dtype: np.dtype) -> tuple[list[np.ndarray], Callable[[], None]]:
        need = sum(int(np.prod(s)) for s in shapes) * dtype.itemsize
        if int(header.get("shm_bytes", -1)) != need:
            raise ValueError(f"Shared-memory payload of {header.get('shm_bytes')} bytes, expected {need}.")
        shm = _Attached(header["shm_name"])
        arrays, offset = [], 0
        for shape in shapes:
            view = np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=offset)
            arrays.append(view)
            offset += view.nbytes

        def release() -> None:
            arrays.clear()  # drop the views before unmapping
            try:
                shm.close()
            except BufferError:
                pass  # a view is still referenced somewhere; the mapping goes with it

        return arrays, release

    def close(self) -> None:
        with self._lock:
            segments = list(self._all.values())
            self._all.clear()
            self._free.clear()
        for shm in segments:
            try:
                shm.close()
                shm.unlink()
            except (FileNotFoundError, BufferError):
                pass
