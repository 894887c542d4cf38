"""Stat loggers: Prometheus collectors with vLLM's metric names, and the periodic throughput log line.

Names and labels (``model_name``, ``engine``) follow vLLM so its Grafana
dashboards and autoscalers work unchanged; figures only FastDeploy has are
under ``fastdeploy:``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    gc_collector,
    platform_collector,
    process_collector,
)

from fastdeploy.distributed.kv_transfer.metrics import KVTransferMetrics
from fastdeploy.engine.request import SchedulerStats
from fastdeploy.logger import init_logger
from fastdeploy.metrics.stats import IterationStats
from fastdeploy.spec_decode.metrics import SpecDecodingProm, SpecDecodingTotals

logger = init_logger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(value)
        scale *= 10


# Metrics deprecated and hidden in the vLLM release FastDeploy follows, each a factory registering it:
# exported only with --show-hidden-metrics-for-version set to the previous minor version. None now.
HIDDEN_METRICS: list[Callable[[CollectorRegistry, str], object]] = []


class PrometheusStatLogger:
    """The Prometheus side of the stats: one registry the server's /metrics exposes."""

    def __init__(self, model_name: str, max_model_len: int, cache_info: dict[str, str] | None = None,
                 registry: CollectorRegistry | None = None, show_hidden_metrics: bool = False,
                 num_spec_tokens: int | None = None, engine_index: int = 0,
                 shared: PrometheusStatLogger | None = None) -> None:
        # Data parallel: one logger per engine, each writing its own ``engine`` label of the same
        # metric families (``shared``: engine 0's logger, which registered them).
        self.registry = shared.registry if shared is not None else registry or CollectorRegistry()
        self._families: dict[str, Any] = shared._families if shared is not None else {}
        if shared is None:
            # --show-hidden-metrics-for-version: the deprecated metrics hidden in the followed vLLM release
            # (HIDDEN_METRICS) are registered only then. vLLM 0.33 hides none of the metrics exported here.
            self.hidden_metrics = [factory(self.registry, model_name) for factory in HIDDEN_METRICS] \
                if show_hidden_metrics else []
            if show_hidden_metrics and not HIDDEN_METRICS:
                logger.info("--show-hidden-metrics-for-version: this release hides no metrics, so it exports "
                            "nothing more.")
            for collector in (process_collector.ProcessCollector, platform_collector.PlatformCollector,
                              gc_collector.GCCollector):
                collector(registry=self.registry)
        else:
            self.hidden_metrics = shared.hidden_metrics
        labels = ["model_name", "engine"]
        values = (model_name, str(engine_index))

        def family(cls: type, name: str, doc: str, labelnames: list[str], **kwargs: Any) -> Any:
            if name not in self._families:
                self._families[name] = cls(name, doc, labelnames, registry=self.registry, **kwargs)
            return self._families[name]

        def gauge(name: str, doc: str) -> Gauge:
            return family(Gauge, name, doc, labels).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return family(Counter, name, doc, labels).labels(*values)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return family(Histogram, name, doc, labels, buckets=buckets).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        # capacity: waiting for room in the batch (KV blocks, budget); deferred: waiting for something
        # else to arrive first (the KV cache from a prefill instance).
        by_reason = family(Gauge, "vllm:num_requests_waiting_by_reason", "Number of requests waiting, by reason.",
                           [*labels, "reason"])
        self.waiting_by_reason = {reason: by_reason.labels(*values, reason) for reason in ("capacity", "deferred")}
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.kv_used_blocks = gauge("fastdeploy:kv_cache_used_blocks", "KV-cache blocks held by requests.")
        self.kv_total_blocks = gauge("fastdeploy:kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # vllm:spec_decode_*: registered only when speculative decoding is configured, as in vLLM.
        self.spec_decode = None if num_spec_tokens is None else SpecDecodingProm(family, labels, values,
                                                                                 num_spec_tokens)
        success = family(Counter, "vllm:request_success", "Count of successfully processed requests.",
                         [*labels, "finished_reason"])
        self.request_success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        taken = family(Counter, "fastdeploy:global_scheduler_requests_taken",
                       "Requests this engine took from the global scheduler's queues and ran, by source "
                       "(own: submitted to this instance; stolen: from another instance's queue).",
                       [*labels, "source"])
        self.global_taken = {source: taken.labels(*values, source) for source in ("own", "stolen")}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_max_tokens = histogram("vllm:request_params_max_tokens",
                                            "Histogram of the max_tokens request parameter.", token_buckets)
        self.request_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                   [1, 2, 5, 10, 20])
        self.request_preemptions = histogram("vllm:request_num_preemptions",
                                             "Number of preemptions per finished request.", [0, 1, 2, 5, 10, 20, 50])
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              _TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             _ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        _REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", _REQUEST_LATENCY_BUCKETS)
        if cache_info:
            info = family(Gauge, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                          [*cache_info, "engine"])
            info.labels(*cache_info.values(), str(engine_index)).set(1)
        self._last_preemptions = 0
        # fastdeploy:kv_transfer_* (disaggregated serving), fed by the engine's transfer events.
        self.kv_transfer = KVTransferMetrics(registry=self.registry) if shared is None else shared.kv_transfer

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Apply one step's scheduler figures and iteration stats."""
        if scheduler_stats is not None:
            self.running.set(scheduler_stats.num_running_reqs)
            self.waiting.set(scheduler_stats.num_waiting_reqs)
            self.waiting_by_reason["capacity"].set(scheduler_stats.num_waiting_reqs - scheduler_stats.num_deferred_reqs)
            self.waiting_by_reason["deferred"].set(scheduler_stats.num_deferred_reqs)
            self.kv_usage.set(scheduler_stats.kv_cache_usage)
            self.kv_used_blocks.set(scheduler_stats.num_used_blocks)
            self.prefix_queries.inc(scheduler_stats.prefix_cache_queries)
            self.prefix_hits.inc(scheduler_stats.prefix_cache_hits)
            # The scheduler reports a running total; the counter takes the increase.
            new_preemptions = scheduler_stats.num_preemptions - self._last_preemptions
            if new_preemptions > 0:
                self.preemptions.inc(new_preemptions)
            self._last_preemptions = scheduler_stats.num_preemptions
            if scheduler_stats.kv_transfer_events:
                self.kv_transfer.apply_events(scheduler_stats.kv_transfer_events)
            self.global_taken["own"].inc(scheduler_stats.num_global_own_reqs)
            self.global_taken["stolen"].inc(scheduler_stats.num_global_stolen_reqs)
            if self.spec_decode is not None and scheduler_stats.spec_decoding_stats is not None:
                self.spec_decode.observe(scheduler_stats.spec_decoding_stats)
        if iteration_stats is None:
            return
        self.prompt_tokens.inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.inc(iteration_stats.num_generation_tokens)
        step_tokens = iteration_stats.num_prompt_tokens + iteration_stats.num_generation_tokens
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
        for ttft in iteration_stats.time_to_first_tokens_iter:
            self.ttft.observe(ttft)
        for itl in iteration_stats.inter_token_latencies_iter:
            self.itl.observe(itl)
        for finished in iteration_stats.finished_requests:
            self.request_success[finished.finish_reason if finished.finish_reason in FINISH_REASONS else "error"].inc()
            self.e2e.observe(finished.e2e_latency)
            self.queue_time.observe(finished.queued_time)
            self.inference_time.observe(finished.inference_time)
            self.prefill_time.observe(finished.prefill_time)
            self.decode_time.observe(finished.decode_time)
            self.request_prompt_tokens.observe(finished.num_prompt_tokens)
            self.request_generation_tokens.observe(finished.num_generation_tokens)
            if finished.max_tokens_param:
                self.request_max_tokens.observe(finished.max_tokens_param)
            self.request_n.observe(finished.n_param)
            self.request_preemptions.observe(finished.num_preemptions)


class LoggingStatLogger:
    """Logs throughput and scheduler state every interval (quiet while idle)."""

    def __init__(self, num_spec_tokens: int | None = None) -> None:
        self.spec_decode = None if num_spec_tokens is None else SpecDecodingTotals(num_spec_tokens)
        self.last_log_time = time.monotonic()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.last_scheduler_stats = SchedulerStats()
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._was_busy = False

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.last_scheduler_stats = scheduler_stats
            self.prefix_queries += scheduler_stats.prefix_cache_queries
            self.prefix_hits += scheduler_stats.prefix_cache_hits
            if self.spec_decode is not None and scheduler_stats.spec_decoding_stats is not None:
                self.spec_decode.observe(scheduler_stats.spec_decoding_stats)
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.last_log_time, 1e-9)
        prompt_tps = self.num_prompt_tokens / elapsed
        gen_tps = self.num_generation_tokens / elapsed
        stats = self.last_scheduler_stats
        busy = bool(prompt_tps or gen_tps or stats.num_running_reqs or stats.num_waiting_reqs)
        # One line after activity stops, then silence while idle.
        log_fn = logger.info if busy or self._was_busy else logger.debug
        self._was_busy = busy
        hit_rate = self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
        log_fn(
            "Engine 000: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt_tps, gen_tps, stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage * 100,
            hit_rate * 100,
        )
        if self.spec_decode is not None and (line := self.spec_decode.log_line()) is not None:
            log_fn("Engine 000: %s", line)
        self.last_log_time = now
        self.num_prompt_tokens = self.num_generation_tokens = 0


class StatLoggerManager:
    """Fans the stats out to the Prometheus logger and, unless disabled, the log line."""

    def __init__(self, prometheus: PrometheusStatLogger | list[PrometheusStatLogger], log_stats: bool = True,
                 num_spec_tokens: int | None = None) -> None:
        # One Prometheus logger per data-parallel engine; the first owns the registry.
        self.per_engine = prometheus if isinstance(prometheus, list) else [prometheus]
        self.prometheus = self.per_engine[0]
        self.logging = LoggingStatLogger(num_spec_tokens) if log_stats else None

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               engine_index: int = 0) -> None:
        self.per_engine[engine_index].record(scheduler_stats, iteration_stats)
        if self.logging is not None:
            self.logging.record(scheduler_stats, iteration_stats)

    def log(self) -> None:
        if self.logging is not None:
            self.logging.log()
