"""Which transport a prefill/decode pair uses: shared memory on one host, TCP across hosts.

FastDeploy picks CUDA IPC when both instances are on one node and RDMA otherwise; on CPU the
same choice is shared memory (one copy in, one copy out, no socket) versus TCP over ZMQ.
Two instances are on the same host when their host ids match. The id joins the kernel's boot
id with the machine id, so two processes in different network namespaces of one machine
(which see different IP addresses) still find they can share memory.
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Iterable

SHM = "shm"
TCP = "tcp"


@functools.cache
def local_host_id() -> str:
    """A stable id of this machine (boot id + machine id, else the hostname)."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path, encoding="ascii") as f:
                parts.append(f.read().strip())
        except OSError:
            continue
    return "-".join(p for p in parts if p) or socket.gethostname()


def select_transfer_protocol(local_host_id_: str | None, peer_host_id: str | None,
                             local_protocols: Iterable[str] = (SHM, TCP),
                             peer_protocols: Iterable[str] = (SHM, TCP)) -> str:
    """``shm`` when both ends share a host and both accept it, else ``tcp``.

    An unknown host id (None) never counts as the same host: choosing shared memory across
    machines would fail, while TCP on one machine only costs a little speed.
    """
    local, peer = set(local_protocols), set(peer_protocols)
    if local_host_id_ and local_host_id_ == peer_host_id and SHM in local and SHM in peer:
        return SHM
    if TCP not in local or TCP not in peer:
        raise ValueError(f"No common KV transfer protocol: local {sorted(local)}, peer {sorted(peer)} "
                         f"(hosts {local_host_id_!r} and {peer_host_id!r}).")
    return TCP
