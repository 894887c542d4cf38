"""What the router knows about one serving instance: its registration and its live state.

An instance registers itself with ``POST /register`` (see :mod:`fastdeploy.router.registration`
for the instance side). The body is the JSON form of :class:`InstanceInfo`; FastDeploy's own
field names (``host_ip``, ``pd_comm_port``/``connector_port``, ``transfer_protocol`` with
``ipc``/``rdma``, ``splitwise_role``) are accepted as aliases so FastDeploy launch scripts work.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class InstanceRole(StrEnum):
    """The splitwise role of an instance (``--splitwise-role``)."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, value: Any) -> InstanceRole:
        """A role from its name, FastDeploy's enum index, or vLLM's ``kv_role``."""
        if isinstance(value, InstanceRole):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            # FastDeploy's InstanceRole enum serialises as 0/1/2.
            return (cls.MIXED, cls.PREFILL, cls.DECODE)[value]
        text = str(value).strip().lower()
        text = _KV_ROLE_ALIASES.get(text, text)
        try:
            return cls(text)
        except ValueError:
            raise ValueError(f"Invalid instance role {value!r}; expected one of mixed, prefill, decode.") from None


# vLLM's --kv-transfer-config spells the role as kv_role.
_KV_ROLE_ALIASES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "mixed"}

# FastDeploy names its transfer protocols after the GPU mechanisms; on this build IPC is
# shared memory and RDMA is the network path (TCP), so the names map one to one.
TRANSFER_PROTOCOL_ALIASES = {"ipc": "shm", "rdma": "tcp", "shm": "shm", "tcp": "tcp"}


def normalize_protocols(value: Any) -> list[str]:
    """``"ipc,rdma"`` or ``["shm", "tcp"]`` as a de-duplicated list of ``shm``/``tcp``."""
    if value is None or value == "":
        return ["tcp"]
    items = value.split(",") if isinstance(value, str) else list(value)
    protocols: list[str] = []
    for item in items:
        name = str(item).strip().lower()
        if name not in TRANSFER_PROTOCOL_ALIASES:
            raise ValueError(f"Invalid transfer protocol {item!r}; expected tcp, shm (or FastDeploy's rdma, ipc).")
        mapped = TRANSFER_PROTOCOL_ALIASES[name]
        if mapped not in protocols:
            protocols.append(mapped)
    return protocols


@dataclass
class InstanceInfo:
    """The registration of an instance: where it serves, its role and its KV-transfer endpoint."""

    role: InstanceRole
    host: str
    port: int
    # KV-transfer (PD) endpoint: the connector's port (--pd-comm-port).
    connector_port: int | None = None
    transfer_protocol: list[str] = field(default_factory=lambda: ["tcp"])
    # Identifies the machine, so the router can pick shared memory for a same-host pair.
    host_id: str | None = None
    metrics_port: int | None = None
    model: str | None = None
    tp_size: int = 1
    # Any other fields an instance sends are kept and shown in /instances.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> InstanceInfo:
        """Parse a /register body; a missing or bad field is a ValueError naming it."""
        if not isinstance(data, dict):
            raise ValueError("The registration body must be a JSON object.")
        data = dict(data)
        role = data.pop("role", None)
        role = data.pop("splitwise_role", role)
        if role is None:
            role = "mixed"
        host = data.pop("host", None) or data.pop("host_ip", None)
        if not host:
            raise ValueError("Missing required field 'host'.")
        host = str(host).removeprefix("http://").removeprefix("https://")
        port = data.pop("port", None)
        if port is None:
            raise ValueError("Missing required field 'port'.")
        connector_port = data.pop("connector_port", None)
        for alias in ("pd_comm_port", "kv_port"):
            value = data.pop(alias, None)
            if connector_port is None and value is not None:
                connector_port = value
        if isinstance(connector_port, list | tuple):
            # FastDeploy passes one port per data-parallel rank; rank 0 is the one served here.
            connector_port = connector_port[0] if connector_port else None
        known = {"transfer_protocol", "host_id", "metrics_port", "model", "tp_size"}
        fields_ = {k: data.pop(k) for k in list(data) if k in known}
        try:
            return cls(
                role=InstanceRole.parse(role),
                host=str(host),
                port=_port(port, "port"),
                connector_port=None if connector_port in (None, "", 0, "0") else _port(connector_port, "connector_port"),
                transfer_protocol=normalize_protocols(fields_.get("transfer_protocol")),
                host_id=None if fields_.get("host_id") is None else str(fields_["host_id"]),
                metrics_port=None if fields_.get("metrics_port") in (None, "", 0, "0")
                else _port(fields_["metrics_port"], "metrics_port"),
                model=fields_.get("model"),
                tp_size=int(fields_.get("tp_size") or 1),
                extra=data,
            )
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["role"] = self.role.value
        data["id"] = self.id
        data["url"] = self.url
        return data


def _port(value: Any, name: str) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"Field {name!r} must be a port number, got {value!r}.") from None
    if not 0 < port < 65536:
        raise ValueError(f"Field {name!r} must be in 1..65535, got {port}.")
    return port


@dataclass
class InstanceState:
    """The router's live view of a registered instance (health and the load it routed there)."""

    info: InstanceInfo
    healthy: bool = True
    # Set while a role switch drains the instance: it gets no new work.
    draining: bool = False
    consecutive_failures: int = 0
    unhealthy_since: float | None = None
    last_error: str | None = None
    last_check: float | None = None
    registered_at: float = field(default_factory=time.time)
    # Requests and estimated prompt tokens the router has in flight on it.
    in_flight: int = 0
    in_flight_tokens: int = 0
    total_requests: int = 0
    failed_requests: int = 0
    # The instance's own figure from GET /load (requests it is serving, whoever sent them).
    reported_load: int | None = None

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def role(self) -> InstanceRole:
        return self.info.role

    @property
    def available(self) -> bool:
        return self.healthy and not self.draining

    def mark_healthy(self) -> None:
        self.healthy = True
        self.consecutive_failures = 0
        self.unhealthy_since = None
        self.last_error = None

    def mark_failure(self, error: str, threshold: int = 1) -> bool:
        """Count a failed check or request; True when this failure made the instance unhealthy."""
        self.consecutive_failures += 1
        self.last_error = error
        if self.healthy and self.consecutive_failures >= threshold:
            self.healthy = False
            self.unhealthy_since = time.monotonic()
            return True
        return False

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.info.to_dict(),
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "in_flight_tokens": self.in_flight_tokens,
            "total_requests": self.total_requests,
            "failed_requests": self.failed_requests,
            "reported_load": self.reported_load,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
        }
