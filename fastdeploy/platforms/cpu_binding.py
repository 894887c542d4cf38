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

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastdeploy import envs
from fastdeploy.logger import init_logger

if TYPE_CHECKING:
    from fastdeploy._C import OmpControl

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


def bind_process(cores: frozenset[int], role: str) -> None:
    """Pin every thread of this process to ``cores`` (threads started later inherit it)."""
    if not cores:
        return
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):  # a thread that just ended
            continue
    logger.info("%s process bound to CPU cores %s.", role, ",".join(map(str, sorted(cores))))


def bind_current_thread(cores: frozenset[int] | None) -> None:
    """Pin only the calling thread to ``cores`` (None or empty: leave it as it is)."""
    if cores:
        os.sched_setaffinity(0, cores)  # 0 is the calling thread on Linux, not the whole process


# System-wide CPU pressure (PSI): the "some" line's total is the microseconds during which at least
# one runnable task waited for a core.
CPU_PRESSURE_PATH = "/proc/pressure/cpu"


def read_cpu_stall_us(path: str = CPU_PRESSURE_PATH) -> int | None:
    """The PSI "some" stall total in microseconds, or None where the kernel does not report it."""
    try:
        with open(path) as f:
            line = f.readline()
        return int(line.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


# Milliseconds the workers of a wide step's team spin between parallel regions before they sleep:
# longer than the gaps between a step's kernels, far shorter than the time to the next long step.
WIDE_BLOCKTIME_MS = 2


class WideSteps:
    """A long step (a prefill) computes on every core while the CPU is otherwise free; the rest stay narrow.

    The engine is pinned to its own cores so that the API process's wake-ups never stall a
    decode step. Through a prefill, though (lm-eval's loglikelihood requests are nothing else),
    the core the API process keeps is mostly idle: a step of at least ``min_tokens`` tokens then
    runs with the kernels' OpenMP team widened to every core, and the next short step narrows it
    back. What the step may take is decided from the CPU pressure (PSI) since the last long step:
    when tasks waited for a core more than ``max_stall`` of that time (other processes, or the API
    process and the widened team sharing a core), the steps stay narrow for ``backoff_s``. A
    widened team on a core someone else is using runs at the speed of its slowest thread, no
    faster than a narrow one.

    Only the engine's main thread changes affinity (OpenMP threads it starts while wide inherit
    every core), and its teams change size in the one OpenMP runtime the kernels, oneDNN and
    Paddle share (_C.py: with two, their pools spun in turn on the same cores and two threads
    computed a prefill slower than one). The wait policy is left alone: narrow teams keep the
    runtime's blocktime, and a wide team's workers sleep after ``WIDE_BLOCKTIME_MS``. Every
    kernel computes the same values with any thread count (oneDNN's matmul primitives are kept
    per thread count; the others split rows).
    """

    def __init__(self, binding: CpuBinding, min_tokens: int, omp: OmpControl, *, max_stall: float = 0.2,
                 backoff_s: float = 2.0, pressure_path: str = CPU_PRESSURE_PATH,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.narrow_cores, self.narrow_threads = binding.engine, omp.get_threads()
        self.narrow_blocktime = omp.get_blocktime()
        self.wide_cores = binding.engine | binding.api
        self.min_tokens, self.max_stall, self.backoff_s = min_tokens, max_stall, backoff_s
        self._omp, self._pressure_path, self._clock = omp, pressure_path, clock
        self.wide = False
        self.num_wide_steps = 0
        self._since, self._stall_us = clock(), read_cpu_stall_us(pressure_path)
        self._narrow_until = 0.0

    @classmethod
    def create(cls, binding: CpuBinding | None, min_tokens: int) -> WideSteps | None:
        """For an engine process pinned by ``binding``, or None when there is nothing to widen to or no way to."""
        if binding is None or not binding.api or min_tokens <= 0:
            return None
        if read_cpu_stall_us() is None:
            logger.info("Prefill steps stay on the engine's cores: the kernel reports no CPU pressure (%s).",
                        CPU_PRESSURE_PATH)
            return None
        from fastdeploy import _C

        omp = _C.omp_thread_control()
        if omp is None:
            return None
        steps = cls(binding, min_tokens, omp)
        logger.info("Steps of %d tokens or more compute on CPU cores %s while the CPU is otherwise free.", min_tokens,
                    ",".join(map(str, sorted(steps.wide_cores))))
        return steps

    def for_step(self, num_tokens: int) -> None:
        """Widen or narrow before a step of ``num_tokens`` tokens (only a change costs syscalls)."""
        wide = num_tokens >= self.min_tokens and self._cpu_free()
        self.num_wide_steps += wide
        if wide == self.wide:
            return
        bind_current_thread(self.wide_cores if wide else self.narrow_cores)
        if wide:
            # The wide team's workers sleep soon after the step instead of spinning (KMP_BLOCKTIME,
            # 200 ms by default) on the cores the API process keeps; narrow teams keep the default.
            self._omp.set_blocktime(WIDE_BLOCKTIME_MS)
            self._omp.set_threads(len(self.wide_cores))
        else:
            self._omp.set_threads(self.narrow_threads)
            self._omp.set_blocktime(self.narrow_blocktime)
        self.wide = wide
        logger.debug("Step of %d tokens: %s.", num_tokens, "wide" if wide else "narrow")

    def _cpu_free(self) -> bool:
        now, stall_us = self._clock(), read_cpu_stall_us(self._pressure_path)
        if stall_us is None or self._stall_us is None:
            return False
        waited = (stall_us - self._stall_us) / 1e6 > self.max_stall * (now - self._since)
        if waited:
            self._narrow_until = now + self.backoff_s
            logger.debug("Tasks waited for a CPU %.0f%% of the last %.2f s: steps stay narrow for %.1f s.",
                         100 * (stall_us - self._stall_us) / 1e6 / max(now - self._since, 1e-9), now - self._since,
                         self.backoff_s)
        self._since, self._stall_us = now, stall_us
        return now >= self._narrow_until


def plan_rank_cores(num_ranks: int, allowed: set[int] | None = None,
                    oversubscribe: bool | None = None) -> list[frozenset[int]]:
    """The cores of each of ``num_ranks`` ranks (tensor-parallel workers): equal contiguous shares of ``allowed``.

    Each rank computes on its own cores with as many OpenMP threads; cores left over after the
    equal shares stay with the first ranks' neighbours unused by the ranks (the API process's).

    Raises:
        ValueError: more ranks than cores, unless ``FD_CPU_OVERSUBSCRIBE=1`` (then ranks share
            cores round-robin, one each).
    """
    cores = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    oversubscribe = envs.cpu_oversubscribe() if oversubscribe is None else oversubscribe
    if num_ranks > len(cores):
        if not oversubscribe:
            raise ValueError(
                f"{num_ranks} parallel ranks (--tensor-parallel-size x --data-parallel-size) need at least "
                f"{num_ranks} CPU cores, and this process may use {len(cores)} ({','.join(map(str, cores))}); "
                "lower -tp/-dp, or set FD_CPU_OVERSUBSCRIBE=1 to share cores on purpose."
            )
        return [frozenset({cores[r % len(cores)]}) for r in range(num_ranks)]
    per_rank = len(cores) // num_ranks
    # The last cores, as the single engine takes them: the first ones stay with the API process.
    first = len(cores) - per_rank * num_ranks
    return [frozenset(cores[first + r * per_rank: first + (r + 1) * per_rank]) for r in range(num_ranks)]
