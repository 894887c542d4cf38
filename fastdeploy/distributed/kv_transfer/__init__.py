"""KV-cache transfer between instances (prefill -> decode): one interface, two transports.

``create_kv_connector(kv_caches, host, port)`` gives a connector that sends to each peer
over shared memory when the peer is on this host and over TCP (ZMQ) otherwise, as
FastDeploy chooses CUDA IPC or RDMA; ``protocol="tcp"``/``"shm"`` pins one.

Modules: ``base`` (the connector and transport interfaces, shared types), ``zmq_connector``
(the connector: ZMQ control plane), ``tcp_transport`` and ``shm_transport`` (how the array
bytes travel), ``topology`` (which transport for which peer), ``metrics``, ``pd_engine`` (the
engine's use of a connector for prefill/decode disaggregation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fastdeploy.distributed.kv_transfer.base import (
    KVConnectorBase,
    KVTransferError,
    KVTransferTimeout,
    PayloadTransport,
    PeerAddress,
    TransferResult,
)
from fastdeploy.distributed.kv_transfer.metrics import KVTransferMetrics
from fastdeploy.distributed.kv_transfer.topology import SHM, TCP, local_host_id, select_transfer_protocol
from fastdeploy.distributed.kv_transfer.zmq_connector import SharedMemoryConnector, TCPConnector, ZmqKVConnector

__all__ = ["SHM", "TCP", "KVConnectorBase", "KVTransferError", "KVTransferMetrics", "KVTransferTimeout",
           "PayloadTransport", "PeerAddress", "SharedMemoryConnector", "TCPConnector", "TransferResult",
           "ZmqKVConnector", "create_kv_connector", "local_host_id", "select_transfer_protocol"]


def create_kv_connector(kv_caches: Sequence[tuple[np.ndarray, np.ndarray]], host: str = "127.0.0.1",
                        port: int = 0, protocol: str = "auto", **kwargs: Any) -> ZmqKVConnector:
    """A connector for these caches listening on ``host:port`` (0: any free port).

    ``protocol``: ``auto`` (per peer by topology), ``tcp`` or ``shm``; FastDeploy's names
    ``rdma`` and ``ipc`` are accepted for them. Every connector receives both transports.
    """
    protocol = {"rdma": TCP, "ipc": SHM}.get(protocol, protocol)
    if protocol == TCP:
        return TCPConnector(kv_caches, host, port, **kwargs)
    if protocol == SHM:
        return SharedMemoryConnector(kv_caches, host, port, **kwargs)
    return ZmqKVConnector(kv_caches, host, port, protocol=protocol, **kwargs)
