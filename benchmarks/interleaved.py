"""Timing shared by the per-call kernel benchmarks: calls interleaved round by round, medians, one JSON.

Interleaving makes load from other work on a shared machine hit every variant alike; the JSON
records the load average so a reader can tell a quiet run from a busy one.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable


def interleaved_medians(calls: dict[str, Callable[[], object]], reps: int, inner: int = 1) -> dict[str, float]:
    """Median microseconds per call of each of ``calls``: one warm-up call each, then ``reps`` rounds in
    which every call runs ``inner`` times in turn."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def write_result(path: str | None, result: dict) -> None:
    """``result`` with the load average and how to read it, as JSON at ``path`` (nothing when None)."""
    result = result | {"load_average": round(os.getloadavg()[0], 1),
                       "note": "medians of interleaved calls; on a shared machine compare rows only within this run"}
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
