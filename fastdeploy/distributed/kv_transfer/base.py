"""The KV transfer connector interface and the types every connector and transport share.

Roles: the prefill side *sends* a request's KV blocks; the decode side has *pre-allocated*
blocks for the request and receives into them. A connector does both (an instance can switch
role). Data for one request may come in several messages: a subset of layers (layer-wise
transfer, as each layer finishes) or a range of the request's blocks; the sender marks the
last message ``final`` and may attach metadata (the first sampled token, for example).

Blocks are the engine's KV-cache layout: per layer a K and a V array of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; ``kv_caches[layer] = (K, V)`` are numpy
views of the engine's cache (see :func:`fastdeploy.distributed.kv_transfer.utils.numpy_kv_caches`).

This module imports no connector or transport: :mod:`.zmq_connector` implements
:class:`KVConnectorBase`, :mod:`.tcp_transport` and :mod:`.shm_transport` implement
:class:`PayloadTransport`, and all of them import only this module (and :mod:`.topology`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fastdeploy.distributed.kv_transfer.topology import TCP

if TYPE_CHECKING:
    import zmq

__all__ = ["KVConnectorBase", "KVTransferError", "KVTransferTimeout", "PayloadTransport", "PeerAddress",
           "TransferResult"]


class KVTransferError(RuntimeError):
    """A transfer failed (peer unreachable or gone, refused, mismatched layout, aborted)."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class KVTransferTimeout(KVTransferError, TimeoutError):
    """A transfer did not complete in time (the peer is probably gone)."""


@dataclass(frozen=True)
class PeerAddress:
    """Where a connector receives: its ZMQ endpoint and the machine it runs on."""

    host: str
    port: int
    host_id: str | None = None

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "host_id": self.host_id}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PeerAddress:
        return cls(str(data["host"]), int(data["port"]), data.get("host_id"))


@dataclass
class TransferResult:
    """What moved for one request (on either side)."""

    request_id: str
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    protocol: str = TCP
    meta: dict[str, Any] = field(default_factory=dict)


class KVConnectorBase(abc.ABC):
    """Moves KV blocks of requests between instances.

    Decode side: :meth:`expect` (or :meth:`request_pull`) registers a request's pre-allocated
    blocks, then :meth:`wait` blocks until they are filled, or :meth:`poll` reports finished
    and failed receives without blocking (for the engine loop). Prefill side:
    :meth:`send_blocks` pushes blocks to a peer, or :meth:`publish` holds them for a peer to
    pull. :meth:`abort` drops a request on either side; :meth:`close` releases everything.
    """

    protocol: str = ""

    @property
    @abc.abstractmethod
    def address(self) -> PeerAddress:
        """Where peers reach this connector."""

    @abc.abstractmethod
    def expect(self, request_id: str, block_ids: Sequence[int], timeout_s: float | None = None) -> None:
        """Receive ``request_id``'s KV into these pre-allocated blocks (in order)."""

    @abc.abstractmethod
    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferResult:
        """Block until the expected request is complete; raise KVTransferError if it fails or times out."""

    @abc.abstractmethod
    def poll(self) -> tuple[dict[str, TransferResult], dict[str, KVTransferError]]:
        """Receives finished and failed since the last call (non-blocking)."""

    @abc.abstractmethod
    def send_blocks(self, peer: PeerAddress, request_id: str, block_ids: Sequence[int], *,
                    layers: Sequence[int] | None = None,
                    kv: Sequence[tuple[np.ndarray, np.ndarray]] | None = None, final: bool = True,
                    meta: dict[str, Any] | None = None, timeout_s: float | None = None) -> TransferResult:
        """Send these blocks (all layers, or ``layers``; from the cache, or the given arrays) to ``peer``."""

    @abc.abstractmethod
    def publish(self, request_id: str, block_ids: Sequence[int], meta: dict[str, Any] | None = None,
                ttl_s: float | None = None) -> None:
        """Hold blocks for a peer to pull; ``on_publish_done`` says when they may be freed."""

    @abc.abstractmethod
    def request_pull(self, peer: PeerAddress, request_id: str, block_ids: Sequence[int],
                     remote_request_id: str | None = None, timeout_s: float | None = None) -> None:
        """Expect ``request_id`` into ``block_ids`` and ask ``peer`` to send what it published."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Forget the request: later data for it is refused, published blocks are released."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the receiver thread and release sockets and shared memory."""


class PayloadTransport(abc.ABC):
    """How the array bytes of a message travel (the control message always goes over ZMQ)."""

    name: str = ""

    @abc.abstractmethod
    def pack(self, sources: Sequence[np.ndarray], ids: np.ndarray | None,
             nbytes: int) -> tuple[dict[str, Any], list[Any], Callable[[], None]]:
        """Header fields, ZMQ payload frames, and a release callback run once the receiver acknowledged.

        The payload is ``source[ids]`` for each source (``source`` itself when ``ids`` is None),
        gathered with a single copy into wherever the transport carries it.
        """

    @abc.abstractmethod
    def unpack(self, header: dict[str, Any], frames: Sequence[zmq.Frame], shapes: Sequence[tuple[int, ...]],
               dtype: np.dtype) -> tuple[list[np.ndarray], Callable[[], None]]:
        """Array views of a received message and a callback that releases them after use."""

    def close(self) -> None:  # noqa: B027 - optional hook; only the shared-memory transport holds anything
        """Release what the transport holds (shared-memory segments)."""
