"""KV-transfer figures: plain counters always, Prometheus metrics when given a registry.

Names follow the project's rule for FastDeploy-only figures (the ``fastdeploy:`` prefix):
``fastdeploy:kv_transfer_bytes_total``, ``..._blocks_total``, ``..._requests_total``,
``..._failures_total`` (labels ``direction`` = send|recv and ``protocol`` = tcp|shm) and the
``fastdeploy:kv_transfer_seconds`` histogram (time of one request's transfer).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram as PromHistogram

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class KVTransferMetrics:
    """Counters of what moved (bytes, blocks, requests, seconds) and what failed, by direction."""

    registry: CollectorRegistry | None = None
    bytes: Counter = field(default_factory=Counter)
    blocks: Counter = field(default_factory=Counter)
    requests: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)

    # Keep every record as an event for drain_events() (the engine ships them to the API process).
    keep_events: bool = False

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[tuple[str, str, str, int, int, float]] = []
        self._prom = None
        if self.registry is not None:
            labels = ["direction", "protocol"]
            self._prom = {
                "bytes": PromCounter("fastdeploy:kv_transfer_bytes", "KV-cache bytes moved between instances.",
                                     labels, registry=self.registry),
                "blocks": PromCounter("fastdeploy:kv_transfer_blocks",
                                      "KV-cache blocks moved between instances (one block = all layers).", labels,
                                      registry=self.registry),
                "requests": PromCounter("fastdeploy:kv_transfer_requests", "Requests whose KV cache was moved.",
                                        labels, registry=self.registry),
                "failures": PromCounter("fastdeploy:kv_transfer_failures",
                                        "KV transfers that failed (peer gone, timeout, refused).", labels,
                                        registry=self.registry),
                "seconds": PromHistogram("fastdeploy:kv_transfer_seconds",
                                         "Time to move one request's KV cache.", labels, buckets=_SECONDS_BUCKETS,
                                         registry=self.registry),
            }

    def record_transfer(self, direction: str, protocol: str, num_bytes: int, num_blocks: int,
                        seconds: float) -> None:
        """One request's KV cache fully moved."""
        key = (direction, protocol)
        with self._lock:
            self.bytes[key] += num_bytes
            self.blocks[key] += num_blocks
            self.requests[key] += 1
            self.seconds[key] += seconds
            if self.keep_events:
                self._events.append(("ok", direction, protocol, int(num_bytes), int(num_blocks), float(seconds)))
        if self._prom is not None:
            self._prom["bytes"].labels(*key).inc(num_bytes)
            self._prom["blocks"].labels(*key).inc(num_blocks)
            self._prom["requests"].labels(*key).inc()
            self._prom["seconds"].labels(*key).observe(seconds)

    def record_failure(self, direction: str, protocol: str) -> None:
        key = (direction, protocol)
        with self._lock:
            self.failures[key] += 1
            if self.keep_events:
                self._events.append(("failed", direction, protocol, 0, 0, 0.0))
        if self._prom is not None:
            self._prom["failures"].labels(*key).inc()

    def total(self, name: str, direction: str | None = None) -> float:
        """Sum of counter ``name`` (bytes, blocks, requests, failures, seconds), optionally one direction."""
        counter: Counter = getattr(self, name)
        with self._lock:
            return sum(v for (d, _), v in counter.items() if direction is None or d == direction)

    def drain_events(self) -> list[tuple[str, str, str, int, int, float]]:
        """Records since the last call: ("ok"|"failed", direction, protocol, bytes, blocks, seconds)."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def apply_events(self, events: list[tuple[str, str, str, int, int, float]]) -> None:
        """Replay another process's drained events into these counters."""
        for outcome, direction, protocol, num_bytes, num_blocks, seconds in events:
            if outcome == "ok":
                self.record_transfer(direction, protocol, num_bytes, num_blocks, seconds)
            else:
                self.record_failure(direction, protocol)
