"""AsyncLLM: the asyncio engine client used by the API server (vLLM's ``AsyncLLM`` / ``AsyncLLMEngine``).

The engine core runs in its own process (:mod:`fastdeploy.engine.core_proc`).
This process tokenizes and validates requests (:class:`Processor`), sends them
over ZMQ, and an output-handler task turns each step's outputs into
``RequestOutput``s (:class:`OutputProcessor`) and hands them to per-request
collectors that ``generate()`` iterates.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Any

from fastdeploy.config import FDConfig, ModelConfig
from fastdeploy.engine.arg_utils import AsyncEngineArgs
from fastdeploy.engine.core_client import EngineCoreClient
from fastdeploy.engine.exceptions import EngineDeadError, EngineGenerateError
from fastdeploy.engine.output_processor import OutputProcessor, ParentRequest
from fastdeploy.engine.processor import Processor
from fastdeploy.inputs import PromptType
from fastdeploy.logger import init_logger
from fastdeploy.metrics.loggers import PrometheusStatLogger, StatLoggerManager
from fastdeploy.metrics.stats import IterationStats
from fastdeploy.outputs import RequestOutput
from fastdeploy.sampling_params import RequestOutputKind, SamplingParams
from fastdeploy.transformers_utils.tokenizer import get_tokenizer_for_model

logger = init_logger(__name__)

# Seconds between two throughput log lines.
STATS_LOG_INTERVAL_S = 10.0

__all__ = ["AsyncEngineArgs", "AsyncLLM", "AsyncLLMEngine", "RequestOutputCollector"]


class RequestOutputCollector:
    """Hands one request's outputs to its consumer; when the consumer lags, DELTA outputs are merged."""

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        if self.output is None or isinstance(output, BaseException):
            self.output = output
            self.ready.set()
        elif isinstance(self.output, RequestOutput):
            self.output.add(output, aggregate=self.aggregate)

    async def get(self) -> RequestOutput:
        while self.output is None:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return None if self.output is None else self._take()

    def _take(self) -> RequestOutput:
        output, self.output = self.output, None
        self.ready.clear()
        if isinstance(output, BaseException):
            raise output
        return output


class AsyncLLM:
    """Asynchronous engine client: ``generate()`` streams ``RequestOutput``s of a request.

    Args:
        fd_config: the resolved engine configuration.
        log_requests: log each request's prompt and parameters.
        log_stats: log throughput every few seconds (Prometheus metrics are always kept).
        engine_core_cls: dotted path of the engine core class (tests swap in a model-free core).
        engine_port: TCP port of the core's request socket (FastDeploy's --engine-worker-queue-port);
            IPC sockets when None.
        max_log_len: most prompt characters and token ids a request log line prints (vLLM's
            --max-log-len); None prints them whole.
    """

    def __init__(self, fd_config: FDConfig, *, log_requests: bool = False, log_stats: bool = True,
                 engine_core_cls: str | None = None, engine_port: int | None = None,
                 max_log_len: int | None = None) -> None:
        self.fd_config = fd_config
        self.model_config = fd_config.model_config
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.tokenizer = get_tokenizer_for_model(self.model_config)
        self.processor = Processor(self.model_config, self.tokenizer, fd_config.structured_outputs_config,
                                   fd_config.kv_transfer_config.enabled)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.collectors: dict[str, RequestOutputCollector] = {}
        self._dead_listeners: list[Callable[[EngineDeadError], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_handler: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        if fd_config.parallel_config.data_parallel_size > 1:
            from fastdeploy.engine.dp_client import DPLBEngineCoreClient

            self.engine_core = DPLBEngineCoreClient(fd_config, engine_core_cls=engine_core_cls, port=engine_port)
        else:
            self.engine_core = EngineCoreClient(fd_config, engine_core_cls=engine_core_cls, port=engine_port)
        cache = fd_config.cache_config
        kv_cache_tokens = cache.num_blocks * cache.block_size
        spec = fd_config.speculative_config
        num_spec_tokens = None if spec is None else spec.num_speculative_tokens
        prometheus = PrometheusStatLogger(
            self.model_config.served_model_name[0] or "",
            self.model_config.max_model_len,
            {"block_size": str(cache.block_size), "num_gpu_blocks": str(cache.num_blocks),
             "enable_prefix_caching": str(cache.enable_prefix_caching),
             # vLLM's capacity labels: tokens the KV cache holds, and how many max_model_len requests fit.
             "kv_cache_size_tokens": str(kv_cache_tokens),
             "kv_cache_max_concurrency": f"{kv_cache_tokens / self.model_config.max_model_len:.2f}"},
            show_hidden_metrics=fd_config.observability_config.show_hidden_metrics,
            num_spec_tokens=num_spec_tokens,
        )
        # Data parallel: the same metrics for each engine, told apart by their ``engine`` label (as vLLM).
        per_engine = [prometheus] + [
            PrometheusStatLogger(self.model_config.served_model_name[0] or "", self.model_config.max_model_len,
                                 num_spec_tokens=num_spec_tokens, engine_index=i,
                                 shared=prometheus)
            for i in range(1, fd_config.parallel_config.data_parallel_size)
        ]
        for logger_ in per_engine:
            logger_.kv_total_blocks.set(cache.num_blocks)
        self.stat_loggers = StatLoggerManager(per_engine, log_stats, num_spec_tokens)
        self.engine_core.on_dead(self._on_engine_dead)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._start_background_tasks()

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, **kwargs: Any) -> AsyncLLM:
        """Build the config from ``engine_args`` and start the engine (vLLM's constructor)."""
        log_requests = getattr(engine_args, "enable_log_requests", False)
        return cls(engine_args.create_engine_config(), log_requests=log_requests,
                   log_stats=not engine_args.disable_log_stats, engine_port=engine_args.engine_worker_queue_port,
                   **kwargs)

    # ---- state ----------------------------------------------------------------------------
    @property
    def errored(self) -> bool:
        """True once the engine core is dead."""
        return self.engine_core.is_dead

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.engine_core.dead_error

    @property
    def is_running(self) -> bool:
        return not self.errored

    @property
    def prometheus_registry(self):
        """Registry with every metric of this engine, for /metrics."""
        return self.stat_loggers.prometheus.registry

    def add_dead_listener(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(error)`` on the event loop once the engine core dies (at once if it is dead)."""
        if self.errored and self._loop is not None:
            self._loop.call_soon(callback, self.dead_error)
            return
        self._dead_listeners.append(callback)

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine core is dead."""
        if self.errored:
            raise self.dead_error

    async def get_tokenizer(self):
        return self.tokenizer

    async def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_num_unfinished_requests(self) -> int:
        return len(self.collectors)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine_core.call_utility_async("reset_prefix_cache"))

    async def switch_role(self, role: str) -> None:
        """Change the engine's disaggregation role (the server drains its requests first)."""
        try:
            await self.engine_core.call_utility_async("switch_role", role)
        except RuntimeError as e:
            raise ValueError(str(e).split(": ", 1)[-1]) from None

    # ---- requests -------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                          priority: int = 0, arrival_time: float | None = None) -> RequestOutputCollector:
        """Validate and send a request; its outputs arrive in the returned collector.

        Raises ValueError (with vLLM's messages) for an invalid prompt or parameters,
        EngineDeadError when the engine core is dead.
        """
        if self.errored:
            raise self.dead_error
        if self._loop is None:
            self._start_background_tasks()
        if request_id in self.collectors:
            raise ValueError(f"Request id {request_id} already running.")
        processed = self.processor.process_request(request_id, prompt, params, arrival_time, priority)
        collector = RequestOutputCollector(params.output_kind)
        core_requests = self.output_processor.add_processed_request(processed)
        try:
            for core_request in core_requests:
                self.engine_core.add_request(core_request)
        except BaseException:
            engine_ids = [r.request_id for r in core_requests]
            self.output_processor.abort_requests([request_id])
            self.engine_core.abort_requests(engine_ids)
            raise
        self.collectors[request_id] = collector
        if self.log_requests:
            # As vLLM's RequestLogger: --max-log-len cuts both the text and the ids.
            cut = slice(None, self.max_log_len)
            text = processed.prompt.text
            logger.info("Added request %s: prompt: %r, params: %s, prompt_token_ids: %s", request_id,
                        text[cut] if text is not None else None, params, processed.prompt.token_ids[cut])
        return collector

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, arrival_time: float | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request; closing the generator early aborts it."""
        collector = await self.add_request(request_id, prompt, sampling_params, priority=priority,
                                           arrival_time=arrival_time)
        stream = self.stream_outputs(request_id, collector)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def stream_outputs(self, request_id: str, collector: RequestOutputCollector,
                             ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of a request added with :meth:`add_request`, until it finishes.

        If the consumer stops early (closes the generator, or its task is cancelled
        because the client went away) the request is aborted at once, synchronously,
        so its KV blocks are freed even when no further await is possible.
        """
        finished = False
        try:
            while not finished:
                output = collector.get_nowait() or await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort([request_id])

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests (and their n > 1 children); their KV blocks are freed."""
        self._abort([request_id] if isinstance(request_id, str) else list(request_id))

    def _abort(self, request_ids: list[str]) -> None:
        stats = IterationStats()
        for request_id in request_ids:
            self.collectors.pop(request_id, None)
            parent = self.output_processor.parents.get(request_id)
            engine_ids = [ParentRequest.child_id(i, request_id) for i in range(parent.n)] if parent else [request_id]
            for engine_id in engine_ids:
                state = self.output_processor.request_states.get(engine_id)
                if state is not None:
                    stats.observe_finished(state, "abort")
        engine_ids = self.output_processor.abort_requests(request_ids)
        self.engine_core.abort_requests(engine_ids)
        if stats.finished_requests:
            self.stat_loggers.record(None, stats)
            if self.log_requests:
                logger.info("Aborted request(s) %s.", ", ".join(request_ids))

    # ---- background tasks -----------------------------------------------------------------
    def _start_background_tasks(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._output_handler = self._loop.create_task(self._run_output_handler(), name="fd-output-handler")
        if self.stat_loggers.logging is not None:
            self._stats_task = self._loop.create_task(self._run_stats_logger(), name="fd-stats-logger")
        if self.errored:
            self._propagate_engine_error(self.dead_error)

    async def _run_output_handler(self) -> None:
        core = self.engine_core
        processor = self.output_processor
        try:
            while True:
                outputs, step_start = await core.get_output_async()
                stats = IterationStats()
                states = []
                for eco in outputs.outputs:
                    state = processor.request_states.get(eco.request_id)
                    if state is not None:
                        stats.observe_output(eco, state, step_start)
                        states.append(state)
                request_outputs, to_abort, failed = processor.process_outputs(outputs)
                for request_id, error in failed.items():
                    collector = self.collectors.pop(request_id, None)
                    if collector is not None:
                        collector.put(EngineGenerateError(error))
                for output in request_outputs:
                    collector = self.collectors.get(output.request_id)
                    if collector is None:
                        continue
                    collector.put(output)
                    if output.finished:
                        del self.collectors[output.request_id]
                for state in states:
                    if state.finished:
                        stats.observe_finished(state, state.finish_reason)
                if to_abort:
                    core.abort_requests(to_abort)
                self.stat_loggers.record(outputs.scheduler_stats, stats, outputs.engine_index)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._propagate_engine_error(e)
        except Exception as e:
            logger.exception("The output handler failed; the engine cannot serve any more.")
            self._propagate_engine_error(EngineDeadError(f"Output handler failed: {type(e).__name__}: {e}"))

    async def _run_stats_logger(self) -> None:
        while True:
            await asyncio.sleep(STATS_LOG_INTERVAL_S)
            self.stat_loggers.log()

    def _on_engine_dead(self, error: EngineDeadError) -> None:
        """Called from the watcher thread (or the output handler) when the core dies."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._propagate_engine_error, error)

    def _propagate_engine_error(self, error: EngineDeadError) -> None:
        """Fail every in-flight request and pending call, stop the handler, tell the listeners (loop thread)."""
        collectors, self.collectors = self.collectors, {}
        for collector in collectors.values():
            collector.put(error)
        self.engine_core.fail_pending_calls(error)
        current = asyncio.current_task()
        for task in (self._output_handler, self._stats_task):
            if task is not None and task is not current and not task.done():
                task.cancel()
        listeners, self._dead_listeners = self._dead_listeners, []
        for listener in listeners:
            listener(error)

    def shutdown(self) -> None:
        """Stop the background tasks and the engine core process."""
        for task in (self._output_handler, self._stats_task):
            if task is not None and not task.done():
                task.cancel()
        self.engine_core.shutdown()


# vLLM's older name of the same class.
AsyncLLMEngine = AsyncLLM
