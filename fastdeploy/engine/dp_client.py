"""Data parallelism behind one API server: N engine-core processes, requests balanced by their load.

:class:`DPLBEngineCoreClient` (vLLM's ``DPLBAsyncMPClient``) has the methods of
:class:`EngineCoreClient` and holds one per engine (``-dp N``), each with its own KV cache,
its own share of the cores and, with ``-tp``, its own tensor-parallel ranks. A new request
goes to the engine with the fewest requests running + waiting, as its last step reported
them plus the requests sent to it since; each request runs on exactly one engine, which
answers its aborts too. Outputs of every engine arrive through one queue, tagged with the
engine's index (``EngineCoreOutputs.engine_index``) for the per-engine metrics.

One engine dying fails the whole server (as in vLLM): /health turns 503 and it exits non-zero.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any

from fastdeploy.config import FDConfig
from fastdeploy.engine.core_client import EngineCoreClient
from fastdeploy.engine.exceptions import EngineDeadError
from fastdeploy.engine.request import EngineCoreOutputs, EngineCoreRequest
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_binding import CpuBinding, plan_rank_cores

logger = init_logger(__name__)


class DPLBEngineCoreClient:
    """``data_parallel_size`` engine cores behind one client, load-balanced."""

    def __init__(self, fd_config: FDConfig, *, engine_core_cls: str | None = None, port: int | None = None,
                 ready_timeout_s: float | None = None) -> None:
        pc = fd_config.parallel_config
        self.fd_config = fd_config
        dp, local_tp = pc.data_parallel_size, pc.tensor_parallel_size // pc.nnodes
        # Each engine's ranks get their own cores (FD_CPU_OVERSUBSCRIBE=1 lets them share).
        rank_cores = plan_rank_cores(dp * local_tp)
        cores = [frozenset().union(*rank_cores[e * local_tp:(e + 1) * local_tp]) for e in range(dp)]
        self.engines: list[EngineCoreClient | None] = [None] * dp
        errors: list[BaseException] = []

        def start(index: int) -> None:
            try:
                engine_port = None if port is None else port + 2 * index
                self.engines[index] = EngineCoreClient(fd_config, engine_core_cls=engine_core_cls, port=engine_port,
                                                       ready_timeout_s=ready_timeout_s, engine_cores=cores[index])
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others finished starting
                errors.append(e)

        # The engines load their models side by side.
        threads = [threading.Thread(target=start, args=(i,), name=f"StartEngine-{i}") for i in range(dp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.shutdown()
            raise errors[0]
        engine_cores = frozenset().union(*cores)
        self.cpu_binding = CpuBinding(engine_cores, frozenset(os.sched_getaffinity(0)) - engine_cores)
        self.ready_info = self.engines[0].ready_info
        # Balancing: each engine's running + waiting at its last step, plus what was sent to it since.
        self.reported_load = [0] * dp
        self.sent_since_report = [0] * dp
        self.request_engine: dict[str, int] = {}
        self._queue: asyncio.Queue | None = None
        self._readers: list[asyncio.Task] = []
        logger.info("Data parallel: %d engines serving (cores %s).", dp,
                    " | ".join(",".join(map(str, sorted(c))) for c in cores))

    # ---- liveness ---------------------------------------------------------------------------------
    @property
    def dead_error(self) -> EngineDeadError | None:
        return next((e.dead_error for e in self.engines if e is not None and e.dead_error is not None), None)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """``callback(error)`` once, when the first engine is found dead."""
        fired = threading.Event()

        def once(error: EngineDeadError) -> None:
            if not fired.is_set():
                fired.set()
                callback(error)

        for engine in self.engines:
            engine.on_dead(once)

    def fail_pending_calls(self, error: BaseException) -> None:
        for engine in self.engines:
            engine.fail_pending_calls(error)

    # ---- requests ---------------------------------------------------------------------------------
    def pick_engine(self) -> int:
        """The engine with the least work: running + waiting as last reported, plus requests sent since."""
        loads = [r + s for r, s in zip(self.reported_load, self.sent_since_report, strict=True)]
        return loads.index(min(loads))

    def add_request(self, request: EngineCoreRequest) -> None:
        index = self.pick_engine()
        self.engines[index].add_request(request)
        self.request_engine[request.request_id] = index
        self.sent_since_report[index] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.request_engine.pop(request_id, None)
            if index is not None:
                by_engine.setdefault(index, []).append(request_id)
        for index, ids in by_engine.items():
            self.engines[index].abort_requests(ids)

    async def call_utility_async(self, method: str, *args: Any) -> object:
        """Run the call on every engine; engine 0's result (all must succeed)."""
        results = await asyncio.gather(*(e.call_utility_async(method, *args) for e in self.engines))
        if all(isinstance(r, bool) for r in results):
            return all(results)
        return results[0]

    async def get_output_async(self) -> tuple[EngineCoreOutputs, float]:
        """The next step's outputs of any engine, tagged with its index."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._readers = [asyncio.get_running_loop().create_task(self._read(i), name=f"fd-dp-reader-{i}")
                             for i in range(len(self.engines))]
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        outputs, step_start = item
        outputs.engine_index = index
        if outputs.scheduler_stats is not None:
            stats = outputs.scheduler_stats
            self.reported_load[index] = stats.num_running_reqs + stats.num_waiting_reqs
            self.sent_since_report[index] = 0
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self.request_engine.pop(output.request_id, None)
        return outputs, step_start

    async def _read(self, index: int) -> None:
        engine = self.engines[index]
        while True:
            try:
                item = await engine.get_output_async()
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, which fails the server
                await self._queue.put((index, e))
                return
            await self._queue.put((index, item))

    # ---- shutdown ---------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        for task in self._readers:
            task.cancel()
        for engine in self.engines:
            if engine is not None:
                engine.shutdown(timeout_s)
