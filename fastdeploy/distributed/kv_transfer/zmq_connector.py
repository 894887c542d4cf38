"""The ZMQ connector: one control plane over ZMQ, the array bytes over a pluggable transport.

Wire protocol (one ZMQ ROUTER socket per connector receives everything): a message is
``[header, *payload]``; the header is a msgpack map and the payload is raw array bytes
(TCP transport) or nothing (shared-memory transport: the header names a segment). Every
message is acknowledged with a msgpack map ``{"seq", "status", "error"}`` where status is
``ok``, ``retry`` (the receiver does not expect that request yet), ``aborted`` or ``error``.
A ``pull`` message asks the receiver's side to send blocks it has *published* to the
requester (vLLM's decode-pulls-from-prefill flow).

Nothing waits forever: every send waits for its acknowledgement at most ``timeout_s``, and a
receive that sees no data by its deadline fails with :class:`KVTransferTimeout`.

:class:`TCPConnector` and :class:`SharedMemoryConnector` are this connector pinned to one
transport for sending (they receive either).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from fastdeploy.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVTransferError,
    KVTransferTimeout,
    PayloadTransport,
    PeerAddress,
    TransferResult,
)
from fastdeploy.distributed.kv_transfer.metrics import KVTransferMetrics
from fastdeploy.distributed.kv_transfer.shm_transport import SharedMemoryTransport
from fastdeploy.distributed.kv_transfer.tcp_transport import TcpTransport
from fastdeploy.distributed.kv_transfer.topology import SHM, TCP, local_host_id, select_transfer_protocol
from fastdeploy.logger import init_logger

__all__ = ["PROTOCOL_VERSION", "SharedMemoryConnector", "TCPConnector", "ZmqKVConnector"]

logger = init_logger("fastdeploy.distributed.kv_transfer")

PROTOCOL_VERSION = 1
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


@dataclass
class _Expected:
    request_id: str
    block_ids: np.ndarray
    deadline: float
    started: float = 0.0
    received: int = 0          # block-layers written so far
    num_bytes: int = 0
    protocol: str = TCP
    done: bool = False
    error: KVTransferError | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Published:
    request_id: str
    block_ids: list[int]
    meta: dict[str, Any]
    deadline: float
    pulled: bool = False


class ZmqKVConnector(KVConnectorBase):
    """The connector: a ZMQ ROUTER thread receives, DEALER sockets send; payloads over a transport.

    ``transports`` maps protocol names to payload transports; which one a send uses is chosen
    per peer from the topology (shared memory for a peer on the same host when both sides
    allow it, TCP otherwise), unless ``protocol`` pins one.
    """

    def __init__(self, kv_caches: Sequence[tuple[np.ndarray, np.ndarray]], host: str = "127.0.0.1", port: int = 0,
                 *, protocol: str = "auto", advertise_host: str | None = None, engine_id: str | None = None,
                 timeout_s: float = 30.0, metrics: KVTransferMetrics | None = None,
                 on_publish_done: Callable[[str, bool, str | None], None] | None = None,
                 host_id: str | None = None) -> None:
        if protocol not in ("auto", TCP, SHM):
            raise ValueError(f"Unknown KV transfer protocol {protocol!r}; expected auto, tcp or shm.")
        self.kv_caches = list(kv_caches)
        if not self.kv_caches:
            raise ValueError("A KV connector needs the KV caches (one (K, V) pair per layer).")
        self.block_shape = tuple(self.kv_caches[0][0].shape[1:])
        self.dtype = self.kv_caches[0][0].dtype
        for layer, (k, v) in enumerate(self.kv_caches):
            if k.shape != v.shape or tuple(k.shape[1:]) != self.block_shape or k.dtype != self.dtype:
                raise ValueError(f"Layer {layer}'s K/V caches do not match layer 0's shape and dtype.")
        self.block_bytes = int(np.prod(self.block_shape)) * self.dtype.itemsize  # one K (or V) block of one layer
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.metrics = metrics or KVTransferMetrics()
        self.on_publish_done = on_publish_done
        self.engine_id = engine_id or f"{host}:{port}"
        self.host_id = host_id or local_host_id()
        self.transports: dict[str, PayloadTransport] = {TCP: TcpTransport(), SHM: SharedMemoryTransport()}
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        bind_host = f"[{host}]" if ":" in host else host
        if host and ":" in host:
            self._router.setsockopt(zmq.IPV6, 1)
        if port:
            self._router.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        wildcard = host in ("0.0.0.0", "::", "*", "")
        self._address = PeerAddress(advertise_host or ("127.0.0.1" if wildcard else host), port, self.host_id)
        self._lock = threading.Condition()
        self._expected: dict[str, _Expected] = {}
        self._finished: dict[str, TransferResult] = {}
        # Completed by the message being handled; published once its acknowledgement is sent.
        self._completed: list[TransferResult] = []
        self._failed: dict[str, KVTransferError] = {}
        self._aborted: set[str] = set()
        self._published: dict[str, _Published] = {}
        # Per request being sent in several messages: [bytes, block-layers, first send time].
        self._sending: dict[str, list[float]] = {}
        self._peers: dict[str, tuple[threading.Lock, zmq.Socket | None]] = {}
        self._peers_lock = threading.Lock()
        self._seq = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-transfer")
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kv-connector-{port}", daemon=True)
        self._thread.start()

    # ---- addressing --------------------------------------------------------------------------
    @property
    def address(self) -> PeerAddress:
        return self._address

    def protocol_for(self, peer: PeerAddress) -> str:
        """The transport for ``peer``: the pinned protocol, else by topology."""
        if self.protocol != "auto":
            if self.protocol == SHM and peer.host_id != self.host_id:
                raise KVTransferError(f"Shared-memory KV transfer needs the peer {peer.endpoint} on this host "
                                      f"(host ids {self.host_id!r} and {peer.host_id!r}).")
            return self.protocol
        return select_transfer_protocol(self.host_id, peer.host_id)

    # ---- receiving ---------------------------------------------------------------------------
    def expect(self, request_id: str, block_ids: Sequence[int], timeout_s: float | None = None) -> None:
        ids = np.asarray(block_ids, dtype=np.int64)
        num_blocks = self.kv_caches[0][0].shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
            raise ValueError(f"Block ids of {request_id} out of range [0, {num_blocks}).")
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            self._aborted.discard(request_id)
            self._expected[request_id] = _Expected(request_id, ids, deadline)

    def wait(self, request_id: str, timeout_s: float | None = None) -> TransferResult:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                if request_id in self._finished:
                    return self._finished.pop(request_id)
                if request_id in self._failed:
                    raise self._failed.pop(request_id)
                entry = self._expected.get(request_id)
                if entry is None:
                    raise KVTransferError(f"Request {request_id} is not expected by this connector.", request_id)
                now = time.monotonic()
                limit = entry.deadline if deadline is None else min(entry.deadline, deadline)
                if now >= limit:
                    if now >= entry.deadline:
                        self._fail_expected(entry, self._timeout_error(entry))
                        raise self._failed.pop(request_id)
                    raise KVTransferTimeout(f"KV cache of {request_id} not received within {timeout_s:.1f} s.",
                                            request_id)
                self._lock.wait(min(limit - now, 0.5))

    def poll(self) -> tuple[dict[str, TransferResult], dict[str, KVTransferError]]:
        with self._lock:
            self._expire_locked()
            finished, failed = self._finished, self._failed
            self._finished, self._failed = {}, {}
        return finished, failed

    def wait_any(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` unless a transfer has finished or failed (for an idle engine loop)."""
        with self._lock:
            if not (self._finished or self._failed):
                self._lock.wait(timeout_s)

    def _timeout_error(self, entry: _Expected) -> KVTransferTimeout:
        got = f"{entry.received} of {len(entry.block_ids) * len(self.kv_caches)} block-layers"
        return KVTransferTimeout(f"KV cache of {entry.request_id} not received in time ({got}); is the sending "
                                 "instance alive?", entry.request_id)

    def _fail_expected(self, entry: _Expected, error: KVTransferError) -> None:
        """Called with the lock held."""
        self._expected.pop(entry.request_id, None)
        entry.error = error
        self._failed[entry.request_id] = error
        self.metrics.record_failure("recv", entry.protocol)
        self._lock.notify_all()

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for entry in [e for e in self._expected.values() if now >= e.deadline]:
            self._fail_expected(entry, self._timeout_error(entry))
        for item in [p for p in self._published.values() if now >= p.deadline and not p.pulled]:
            del self._published[item.request_id]
            self._publish_done(item.request_id, False, "not pulled before its deadline")

    # ---- the receiver thread -----------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        last_expiry = time.monotonic()
        while not self._closed.is_set():
            try:
                events = dict(poller.poll(100))
            except zmq.ZMQError:
                break
            if time.monotonic() - last_expiry > 0.2:
                with self._lock:
                    self._expire_locked()
                last_expiry = time.monotonic()
            if self._router not in events:
                continue
            try:
                identity, header_frame, *payload = self._router.recv_multipart(copy=False)
            except zmq.ZMQError:
                break
            try:
                header = _decode(header_frame.bytes)
                reply = self._handle(header, payload)
            except Exception as e:  # a bad message must not kill the receiver
                logger.exception("Bad KV transfer message")
                header, reply = {}, {"status": "error", "error": f"{type(e).__name__}: {e}"}
            reply["seq"] = header.get("seq") if isinstance(header, dict) else None
            try:
                self._router.send_multipart([identity, _encode(reply)], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # the sender went away; it times out on its side
            # Only now tell waiters a request is complete: a waiter that closes the connector at once
            # must not cut off the acknowledgement the sender is waiting for.
            self._publish_completed()
        # Linger briefly: an acknowledgement queued just before closing must still reach its sender.
        self._router.close(linger=500)

    def _handle(self, header: dict[str, Any], payload: Sequence[zmq.Frame]) -> dict[str, Any]:
        if header.get("v") != PROTOCOL_VERSION:
            return {"status": "error", "error": f"KV transfer protocol version {header.get('v')} is not "
                                                f"{PROTOCOL_VERSION}."}
        kind = header.get("type")
        if kind == "kv":
            return self._handle_kv(header, payload)
        if kind == "pull":
            return self._handle_pull(header)
        if kind == "probe":
            with self._lock:
                if header["request_id"] in self._expected:
                    return {"status": "ok"}
                if header["request_id"] in self._aborted:
                    return {"status": "aborted", "error": f"Request {header['request_id']} was aborted."}
            return {"status": "retry"}
        return {"status": "error", "error": f"Unknown message type {kind!r}."}

    def _handle_kv(self, header: dict[str, Any], payload: Sequence[zmq.Frame]) -> dict[str, Any]:
        request_id = header["request_id"]
        transport = self.transports.get(header.get("transport", TCP))
        if transport is None:
            return {"status": "error", "error": f"Unknown transport {header.get('transport')!r}."}
        with self._lock:
            entry = self._expected.get(request_id)
            if entry is None:
                if request_id in self._aborted:
                    return {"status": "aborted", "error": f"Request {request_id} was aborted by the receiver."}
                # Not yet expected (the decode side has not allocated): the sender retries.
                return {"status": "retry", "error": f"Request {request_id} is not expected (yet)."}
            if not entry.started:
                entry.started = time.monotonic()
                entry.protocol = transport.name
        layers = list(header["layers"])
        offset, count = int(header["block_offset"]), int(header["num_blocks"])
        error = self._check_layout(header, entry, layers, offset, count)
        if error:
            with self._lock:
                self._fail_expected(entry, KVTransferError(error, request_id))
            return {"status": "error", "error": error}
        shape = (count, *self.block_shape)
        arrays, release = transport.unpack(header, payload, [shape] * (2 * len(layers)), self.dtype)
        try:
            dest = entry.block_ids[offset:offset + count]
            for i, layer in enumerate(layers):
                k_cache, v_cache = self.kv_caches[layer]
                k_cache[dest] = arrays[2 * i]
                v_cache[dest] = arrays[2 * i + 1]
        finally:
            release()
        with self._lock:
            entry.received += count * len(layers)
            entry.num_bytes += 2 * count * len(layers) * self.block_bytes
            entry.meta.update(header.get("meta") or {})
            if header.get("final"):
                expected = len(entry.block_ids) * len(self.kv_caches)
                if entry.received != expected:
                    error = (f"KV cache of {request_id} incomplete: {entry.received} of {expected} block-layers "
                             "received before the final message.")
                    self._fail_expected(entry, KVTransferError(error, request_id))
                    return {"status": "error", "error": error}
                self._expected.pop(request_id, None)
                seconds = time.monotonic() - entry.started
                self._completed.append(TransferResult(request_id, len(entry.block_ids), entry.num_bytes, seconds,
                                                      entry.protocol, entry.meta))
                self.metrics.record_transfer("recv", entry.protocol, entry.num_bytes, len(entry.block_ids), seconds)
        return {"status": "ok"}

    def _publish_completed(self) -> None:
        """Move requests completed by the last message to the finished set and wake their waiters."""
        if not self._completed:
            return
        with self._lock:
            for result in self._completed:
                self._finished[result.request_id] = result
            self._completed.clear()
            self._lock.notify_all()

    def _check_layout(self, header: dict[str, Any], entry: _Expected, layers: list[int], offset: int,
                      count: int) -> str | None:
        if np.dtype(header["dtype"]) != self.dtype:
            return f"KV dtype {header['dtype']} does not match this cache's {self.dtype}."
        if tuple(header["block_shape"]) != self.block_shape:
            return f"KV block shape {tuple(header['block_shape'])} does not match this cache's {self.block_shape}."
        if any(not 0 <= layer < len(self.kv_caches) for layer in layers):
            return f"Layer index out of range (this cache has {len(self.kv_caches)} layers)."
        if offset < 0 or offset + count > len(entry.block_ids):
            return (f"Blocks [{offset}, {offset + count}) exceed the {len(entry.block_ids)} blocks allocated for "
                    f"{entry.request_id}.")
        return None

    # ---- sending -----------------------------------------------------------------------------
    def send_blocks(self, peer: PeerAddress, request_id: str, block_ids: Sequence[int], *,
                    layers: Sequence[int] | None = None,
                    kv: Sequence[tuple[np.ndarray, np.ndarray]] | None = None, final: bool = True,
                    meta: dict[str, Any] | None = None, timeout_s: float | None = None,
                    block_offset: int = 0) -> TransferResult:
        """Push blocks to ``peer``; returns once the peer acknowledged (it then owns the data).

        ``kv`` gives the arrays to send directly (``kv[i]`` for ``layers[i]``, each
        ``[len(block_ids), *block_shape]``); otherwise the blocks are read from this connector's
        caches. ``block_offset`` places them at that index of the peer's allocated blocks.
        """
        protocol = self.protocol_for(peer)
        layers = list(range(len(self.kv_caches)) if layers is None else layers)
        ids = np.asarray(block_ids, dtype=np.int64)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        try:
            if kv is None:
                if ids.size and (ids.min() < 0 or ids.max() >= self.kv_caches[0][0].shape[0]):
                    raise ValueError(f"Block ids of {request_id} out of range [0, {self.kv_caches[0][0].shape[0]}).")
                arrays = [a for layer in layers for a in (self.kv_caches[layer][0], self.kv_caches[layer][1])]
                gather = ids
            else:
                if len(kv) != len(layers):
                    raise ValueError(f"{len(kv)} K/V pairs given for {len(layers)} layers.")
                arrays = [a for pair in kv for a in pair]
                want = (len(ids), *self.block_shape)
                if any(a.shape != want or a.dtype != self.dtype for a in arrays):
                    raise ValueError(f"Each given K/V array must be {self.dtype} of shape {want}.")
                gather = None
            nbytes = 2 * len(ids) * len(layers) * self.block_bytes
            transport = self.transports[protocol]
            header = {"v": PROTOCOL_VERSION, "type": "kv", "request_id": request_id, "layers": layers,
                      "block_offset": block_offset, "num_blocks": len(ids), "dtype": self.dtype.str,
                      "block_shape": list(self.block_shape), "final": final, "meta": meta or {},
                      "transport": protocol, "sender": self.engine_id}
            fields, frames, release = transport.pack(arrays, gather, nbytes)
            try:
                header.update(fields)
                self._request(peer, header, frames, timeout, request_id)
            finally:
                release()
        except Exception:
            with self._lock:
                self._sending.pop(request_id, None)
            self.metrics.record_failure("send", protocol)
            raise
        with self._lock:
            acc = self._sending.setdefault(request_id, [0, 0, started])
            acc[0] += nbytes
            acc[1] += len(ids) * len(layers)
            if final:
                del self._sending[request_id]
        if not final:
            return TransferResult(request_id, len(ids), nbytes, time.monotonic() - started, protocol, {})
        # The request's totals over all its messages (layer-wise sends come in several).
        total_bytes, num_blocks, seconds = int(acc[0]), int(acc[1]) // len(self.kv_caches), time.monotonic() - acc[2]
        self.metrics.record_transfer("send", protocol, total_bytes, num_blocks, seconds)
        return TransferResult(request_id, num_blocks, total_bytes, seconds, protocol, dict(meta or {}))

    def send_blocks_async(self, peer: PeerAddress, request_id: str, block_ids: Sequence[int],
                          **kwargs: Any) -> Future:
        """:meth:`send_blocks` on the connector's worker threads (a Future of its TransferResult)."""
        return self._pool.submit(self.send_blocks, peer, request_id, block_ids, **kwargs)

    def _request(self, peer: PeerAddress, header: dict[str, Any], frames: list[Any], timeout: float,
                 request_id: str) -> dict[str, Any]:
        """Send one message and wait for its acknowledgement, retrying while the peer says ``retry``."""
        deadline = time.monotonic() + timeout
        delay = 0.005
        probe = None
        while True:
            # After a "retry", ask with a header-only probe until the peer is ready, then send the data.
            message, payload = (header, frames) if probe is None else (probe, [])
            message["seq"] = next(self._seq)
            reply = self._exchange(peer, message, payload, deadline, request_id)
            status = reply.get("status")
            if status == "ok":
                if probe is None:
                    return reply
                probe = None
                continue
            if status == "retry":
                if frames and probe is None:
                    probe = {"v": PROTOCOL_VERSION, "type": "probe", "request_id": request_id}
                # The receiver has not allocated for the request yet: back off and ask again.
                time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, 0.2)
                if time.monotonic() < deadline:
                    continue
                raise KVTransferTimeout(f"Peer {peer.endpoint} did not expect request {request_id} within "
                                        f"{timeout:.1f} s.", request_id)
            raise KVTransferError(f"Peer {peer.endpoint} refused request {request_id}: {reply.get('error')}",
                                  request_id)

    def _exchange(self, peer: PeerAddress, header: dict[str, Any], frames: list[Any], deadline: float,
                  request_id: str) -> dict[str, Any]:
        endpoint = peer.endpoint
        with self._peers_lock:
            lock, _ = self._peers.setdefault(endpoint, (threading.Lock(), None))
        with lock:
            sock = self._peers[endpoint][1]
            if sock is None:
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                # IMMEDIATE: queue nothing for a peer that is not connected, so a dead peer fails the send.
                sock.setsockopt(zmq.IMMEDIATE, 1)
                if ":" in peer.host:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.connect(endpoint)
                self._peers[endpoint] = (lock, sock)
            ok = False
            try:
                remaining_ms = max(1, int((deadline - time.monotonic()) * 1000))
                sock.setsockopt(zmq.SNDTIMEO, remaining_ms)
                try:
                    sock.send_multipart([_encode(header), *frames], copy=False)
                except zmq.Again:
                    raise KVTransferTimeout(f"Cannot reach KV peer {endpoint} for request {request_id} (no "
                                            "connection; is the peer alive?).", request_id) from None
                while True:
                    remaining_ms = int((deadline - time.monotonic()) * 1000)
                    if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
                        raise KVTransferTimeout(f"No acknowledgement from KV peer {endpoint} for request "
                                                f"{request_id}; is the peer alive?", request_id)
                    reply = _decode(sock.recv())
                    if reply.get("seq") == header["seq"]:
                        ok = True
                        return reply
            finally:
                if not ok:
                    # A late reply must never be read as the answer to a later message: new socket.
                    sock.close(0)
                    self._peers[endpoint] = (lock, None)

    # ---- pull (decode asks, prefill sends what it published) ----------------------------------
    def publish(self, request_id: str, block_ids: Sequence[int], meta: dict[str, Any] | None = None,
                ttl_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout_s if ttl_s is None else ttl_s)
        with self._lock:
            self._published[request_id] = _Published(request_id, list(block_ids), dict(meta or {}), deadline)

    def request_pull(self, peer: PeerAddress, request_id: str, block_ids: Sequence[int],
                     remote_request_id: str | None = None, timeout_s: float | None = None) -> None:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self.expect(request_id, block_ids, timeout)
        header = {"v": PROTOCOL_VERSION, "type": "pull", "request_id": request_id,
                  "remote_request_id": remote_request_id or request_id, "reply_to": self._address.to_dict(),
                  "num_blocks": len(block_ids)}

        def ask() -> None:
            try:
                self._request(peer, header, [], timeout, request_id)
            except KVTransferError as e:
                with self._lock:
                    entry = self._expected.get(request_id)
                    if entry is not None:
                        self._fail_expected(entry, e)

        self._pool.submit(ask)

    def pull(self, peer: PeerAddress, request_id: str, block_ids: Sequence[int],
             remote_request_id: str | None = None, timeout_s: float | None = None) -> TransferResult:
        """:meth:`request_pull` and :meth:`wait` in one blocking call."""
        self.request_pull(peer, request_id, block_ids, remote_request_id, timeout_s)
        return self.wait(request_id)

    def _handle_pull(self, header: dict[str, Any]) -> dict[str, Any]:
        remote_id = header["remote_request_id"]
        with self._lock:
            item = self._published.get(remote_id)
            if item is None or item.pulled:
                return {"status": "error", "error": f"Request {remote_id} is not published here (expired, "
                                                    "already pulled or never prefilled)."}
            if int(header.get("num_blocks", len(item.block_ids))) != len(item.block_ids):
                return {"status": "error", "error": f"Request {remote_id} has {len(item.block_ids)} blocks, the "
                                                    f"puller allocated {header.get('num_blocks')}."}
            item.pulled = True
        requester = PeerAddress.from_dict(header["reply_to"])
        self._pool.submit(self._send_published, item, requester, header["request_id"])
        return {"status": "ok"}

    def _send_published(self, item: _Published, peer: PeerAddress, peer_request_id: str) -> None:
        try:
            self.send_blocks(peer, peer_request_id, item.block_ids, meta=item.meta)
        except Exception as e:
            logger.warning("Sending published KV of %s to %s failed: %s", item.request_id, peer.endpoint, e)
            ok, error = False, str(e)
        else:
            ok, error = True, None
        with self._lock:
            self._published.pop(item.request_id, None)
        self._publish_done(item.request_id, ok, error)

    def _publish_done(self, request_id: str, ok: bool, error: str | None) -> None:
        if self.on_publish_done is not None:
            try:
                self.on_publish_done(request_id, ok, error)
            except Exception:
                logger.exception("on_publish_done failed for %s", request_id)

    # ---- abort / close -----------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        with self._lock:
            entry = self._expected.pop(request_id, None)
            self._aborted.add(request_id)
            if len(self._aborted) > 10_000:
                self._aborted.clear()  # bounded memory; an old id's late data then gets "retry" and times out
            self._finished.pop(request_id, None)
            self._failed.pop(request_id, None)
            self._sending.pop(request_id, None)
            item = self._published.pop(request_id, None)
            if entry is not None:
                self._lock.notify_all()
        if item is not None and not item.pulled:
            self._publish_done(request_id, False, "aborted")

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._thread.join(5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._peers_lock:
            for _, sock in self._peers.values():
                if sock is not None:
                    sock.close(0)
            self._peers.clear()
        for transport in self.transports.values():
            transport.close()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> ZmqKVConnector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TCPConnector(ZmqKVConnector):
    """A connector that always sends over TCP (it receives either transport)."""

    def __init__(self, kv_caches: Sequence[tuple[np.ndarray, np.ndarray]], host: str = "127.0.0.1", port: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(kv_caches, host, port, protocol=TCP, **kwargs)


class SharedMemoryConnector(ZmqKVConnector):
    """A connector that always sends through shared memory (peers must be on this host)."""

    def __init__(self, kv_caches: Sequence[tuple[np.ndarray, np.ndarray]], host: str = "127.0.0.1", port: int = 0,
                 **kwargs: Any) -> None:
        super().__init__(kv_caches, host, port, protocol=SHM, **kwargs)
