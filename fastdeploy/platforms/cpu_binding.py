"""Which CPU cores the engine process computes on, and which the API process keeps.

A decode step at one stream is a few milliseconds of OpenMP work per token, and the API
process (detokenizing, streaming) and a benchmark client wake up at every token too. Left to
the scheduler, those wake-ups land on the engine's core now and then and stall its step; a
step sharing a core was measured 25 ms against 17 ms alone. As vLLM CPU does, the engine is
pinned to its own cores and the API process to the others.

``FD_CPU_OMP_THREADS_BIND`` (or vLLM's ``VLLM_CPU_OMP_THREADS_BIND``):

- ``auto`` (default): when the engine runs fewer OpenMP threads than this process may use
  cores, the engine takes the last ``OMP_NUM_THREADS`` of them and the API process the rest;
  with as many threads as cores nothing is pinned.
- ``nobind``: nothing is pinned.
- a core list such as ``1`` or ``2-3,6``: the engine's cores; the API process keeps the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass

from fastdeploy import envs
from fastdeploy.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class CpuBinding:
    """Cores of the engine process and of the API process (an empty set: leave it as it is)."""

    engine: frozenset[int]
    api: frozenset[int]


def parse_core_list(text: str) -> frozenset[int]:
    """``"0-2,5"`` -> {0, 1, 2, 5}; a ValueError naming the variable for anything else."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 0 or hi < lo:
                raise ValueError(part)
            cores.update(range(lo, hi + 1))
    except ValueError as e:
        raise ValueError(
            f"FD_CPU_OMP_THREADS_BIND must be 'auto', 'nobind' or a core list such as '1' or '2-3,6', got {text!r}."
        ) from e
    return frozenset(cores)


def plan_cpu_binding(omp_threads: int, setting: str | None = None,
                     allowed: set[int] | None = None) -> CpuBinding | None:
    """The binding for an engine with ``omp_threads`` threads, or None when nothing is pinned."""
    setting = (setting if setting is not None else envs.cpu_omp_threads_bind()).strip()
    allowed = set(allowed if allowed is not None else os.sched_getaffinity(0))
    if setting == "nobind":
        return None
    if setting == "auto":
        if omp_threads >= len(allowed):
            return None
        ordered = sorted(allowed)
        engine = frozenset(ordered[len(ordered) - omp_threads:])
        return CpuBinding(engine, frozenset(allowed) - engine)
    engine = parse_core_list(setting)
    if not engine <= allowed:
        raise ValueError(f"FD_CPU_OMP_THREADS_BIND={setting!r} names cores outside the ones this process may use "
                         f"({sorted(allowed)}).")
    return CpuBinding(engine, frozenset(allowed) - engine)


def bind_process(cores: frozenset[int], role: str | None) -> None:
    """Pin every thread of this process to ``cores`` (threads started later inherit it); ``role`` None: no log."""
    if not cores:
        return
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    if role is not None:
        logger.info("%s process bound to CPU cores %s.", role, ",".join(map(str, sorted(cores))))


def _omp_set_num_threads_functions() -> list:
    """``omp_set_num_threads`` of every OpenMP runtime loaded here (Paddle's libiomp5, the kernels' libgomp)."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rsplit(" ", 1)[-1].strip()
            if os.path.basename(path).startswith(("libiomp5", "libgomp", "libomp.")):
                paths.add(path)
    functions = []
    for path in sorted(paths):
        with contextlib.suppress(OSError, AttributeError):
            functions.append(ctypes.CDLL(path).omp_set_num_threads)
    return functions


def _process_sleeping(pid: int) -> bool:
    """Whether ``pid``'s main thread is asleep (waiting on its sockets), from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("S", "D", "I")
    except (OSError, IndexError):
        return False


class WideSteps:
    """Runs a step with many tokens on every core while the API process sleeps; the others on the engine's.

    The engine is pinned to its own cores so that the API process's wake-ups never stall a
    decode step. A prefill step (lm-eval's loglikelihood requests are all prefill) is long,
    and while the API process waits for its outputs the core it keeps is idle: such a step
    widens the engine's affinity and its OpenMP teams to every core, the next small step
    narrows them back. The engine process runs with ``OMP_WAIT_POLICY=PASSIVE`` then
    (core_client.py): two OpenMP runtimes (Paddle's and the kernels') spinning on two cores
    made 2 threads slower than 1 (600-token prefill, fp32: 1.2 s vs 1.05 s; passive: 0.61 s).
    """

    def __init__(self, binding: CpuBinding, threads: int, min_tokens: int, api_pid: int) -> None:
        self.narrow_cores, self.narrow_threads = binding.engine, threads
        self.wide_cores = binding.engine | binding.api
        self.min_tokens, self.api_pid = min_tokens, api_pid
        self._set_threads = _omp_set_num_threads_functions()
        self.wide = False
        self.num_wide_steps = 0

    def for_step(self, num_tokens: int) -> None:
        """Widen or narrow before a step of ``num_tokens`` tokens (only a change costs syscalls)."""
        wide = num_tokens >= self.min_tokens and _process_sleeping(self.api_pid)
        self.num_wide_steps += wide
        if wide == self.wide:
            return
        bind_process(self.wide_cores if wide else self.narrow_cores, None)
        threads = len(self.wide_cores) if wide else self.narrow_threads
        for set_threads in self._set_threads:
            set_threads(threads)
        self.wide = wide
