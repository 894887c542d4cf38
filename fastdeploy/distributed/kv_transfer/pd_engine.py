"""Engine-side glue for prefill/decode disaggregation: the router's protocol on top of a connector.

One :class:`PDKVTransfer` per engine (the process that owns the KV cache). The scheduler
calls it at four points and polls it once per step; it never blocks the engine loop.

Prefill instance (request carries ``kv_transfer_params.do_remote_decode``):
    after the prompt's last chunk is computed and the first token sampled, the scheduler keeps
    the request's blocks and calls ``params = pd.on_prefill_done(request_id, block_ids,
    first_token_id, kv_transfer_params)``; ``params`` go into the HTTP response's
    ``kv_transfer_params``. Each step, ``pd.take_releasable()`` names the requests whose blocks
    may now be freed (sent, pulled, failed or expired).

Decode instance (request carries ``kv_transfer_params.do_remote_prefill``):
    once blocks for the prompt are allocated, ``pd.on_decode_allocated(request_id, block_ids,
    kv_transfer_params)`` starts receiving into them; the request waits. Each step,
    ``done, failed = pd.take_received()``: for ``done[request_id]`` (a dict with
    ``first_token_id``) mark the prompt computed, emit that token and decode on; for
    ``failed[request_id]`` (an error) finish the request with that error and free its blocks.

Either side: ``pd.abort(request_id)`` when a request is aborted or fails (frees nothing by
itself: the scheduler frees the blocks as it does for any finished request).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from fastdeploy.distributed.kv_transfer import create_kv_connector
from fastdeploy.distributed.kv_transfer.base import KVTransferError, PeerAddress
from fastdeploy.distributed.kv_transfer.metrics import KVTransferMetrics
from fastdeploy.distributed.kv_transfer.zmq_connector import ZmqKVConnector
from fastdeploy.logger import init_logger

logger = init_logger("fastdeploy.distributed.kv_transfer.pd_engine")

CONCURRENT = "concurrent"


class PDKVTransfer:
    """Drives KV transfer for the requests of one engine, for both router protocols."""

    def __init__(self, kv_caches: Sequence[tuple[np.ndarray, np.ndarray]], host: str = "0.0.0.0", port: int = 0,
                 *, advertise_host: str | None = None, protocol: str = "auto", timeout_s: float = 120.0,
                 metrics: KVTransferMetrics | None = None) -> None:
        self._lock = threading.Lock()
        self._releasable: list[tuple[str, bool, str | None]] = []
        # Decode side, concurrent protocol: the prefill pushes under the router's request id, which
        # differs from this engine's id for the request; connector key -> engine request id.
        self._engine_ids: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        self.connector: ZmqKVConnector = create_kv_connector(
            kv_caches, host, port, protocol=protocol, advertise_host=advertise_host, timeout_s=timeout_s,
            metrics=metrics, on_publish_done=self._on_sent)

    @property
    def address(self) -> PeerAddress:
        return self.connector.address

    # ---- prefill side ------------------------------------------------------------------------
    def on_prefill_done(self, request_id: str, block_ids: Sequence[int], first_token_id: int,
                        params: dict[str, Any], num_tokens: int | None = None) -> dict[str, Any]:
        """Hand the request's KV over; returns the ``kv_transfer_params`` of the prefill answer."""
        meta = {"first_token_id": int(first_token_id)}
        if params.get("mode") == CONCURRENT:
            peer = _peer(params)
            future = self.connector.send_blocks_async(peer, params.get("remote_request_id") or request_id,
                                                      list(block_ids), meta=meta)
            future.add_done_callback(lambda f: self._on_sent(request_id, f.exception() is None,
                                                             None if f.exception() is None else str(f.exception())))
        else:
            # Sequential (vLLM's): hold the blocks until the decode instance pulls them (or they expire).
            self.connector.publish(request_id, list(block_ids), meta=meta)
        address = self.connector.address
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.connector.engine_id,
                "remote_host": address.host, "remote_port": address.port, "remote_host_id": address.host_id,
                "remote_request_id": request_id, "remote_block_ids": [int(b) for b in block_ids],
                "remote_num_tokens": num_tokens, "first_token_id": int(first_token_id),
                "transfer_protocol": params.get("transfer_protocol")}

    def _on_sent(self, request_id: str, ok: bool, error: str | None) -> None:
        if not ok:
            logger.warning("KV of %s was not delivered: %s", request_id, error)
        with self._lock:
            self._releasable.append((request_id, ok, error))

    def take_releasable(self) -> list[tuple[str, bool, str | None]]:
        """(request_id, delivered, error) of prefill-side requests whose blocks may be freed now."""
        with self._lock:
            out, self._releasable = self._releasable, []
        return out

    # ---- decode side -------------------------------------------------------------------------
    def on_decode_allocated(self, request_id: str, block_ids: Sequence[int], params: dict[str, Any]) -> None:
        """Start receiving the request's KV into its freshly allocated blocks."""
        if params.get("mode") == CONCURRENT:
            key = str(params.get("remote_request_id") or request_id)
            self._engine_ids[key], self._keys[request_id] = request_id, key
            self.connector.expect(key, list(block_ids))  # the prefill instance pushes
        else:
            self.connector.request_pull(_peer(params), request_id, list(block_ids),
                                        remote_request_id=params.get("remote_request_id"))

    def take_received(self) -> tuple[dict[str, dict[str, Any]], dict[str, KVTransferError]]:
        """Requests whose KV arrived (with the prefill's metadata) and those whose transfer failed."""
        finished, failed = self.connector.poll()
        return ({self._engine_id(key): result.meta for key, result in finished.items()},
                {self._engine_id(key): error for key, error in failed.items()})

    def _engine_id(self, key: str) -> str:
        request_id = self._engine_ids.pop(key, key)
        self._keys.pop(request_id, None)
        return request_id

    def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, waking early when a transfer into this engine ends."""
        self.connector.wait_any(timeout_s)

    # ---- both --------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        key = self._keys.pop(request_id, request_id)
        self._engine_ids.pop(key, None)
        self.connector.abort(key)

    def close(self) -> None:
        self.connector.close()


def _peer(params: dict[str, Any]) -> PeerAddress:
    try:
        return PeerAddress(str(params["remote_host"]), int(params["remote_port"]), params.get("remote_host_id"))
    except (KeyError, TypeError, ValueError):
        raise KVTransferError(f"kv_transfer_params lack the peer's remote_host/remote_port: {params}") from None
