"""vLLM's spec-decode Prometheus counters and the acceptance log line."""

import logging

from prometheus_client import generate_latest

from fastdeploy.engine.request import SchedulerStats
from fastdeploy.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from fastdeploy.spec_decode.scheduling import SpecDecodingStats


def _stats():
    stats = SpecDecodingStats(3)
    stats.observe(3, 2)
    stats.observe(3, 0)
    stats.observe(2, 2)
    return SchedulerStats(num_running_reqs=1, spec_decoding_stats=stats.take())


def test_counters_with_vllm_names_and_labels():
    prom = PrometheusStatLogger("m", 128, num_spec_tokens=3)
    prom.record(_stats(), None)
    text = generate_latest(prom.registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 8.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0' in text
    per_pos = 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="%d"} %.1f'
    for pos, value in enumerate([2, 2, 0]):
        assert per_pos % (pos, value) in text


def test_not_registered_without_speculation():
    assert "spec_decode" not in generate_latest(PrometheusStatLogger("m", 128).registry).decode()


def test_log_line_reports_acceptance():
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log = LoggingStatLogger(num_spec_tokens=3)
    log.record(_stats(), None)
    handler, package_logger = Collect(), logging.getLogger("fastdeploy")
    package_logger.addHandler(handler)
    try:
        log.log()
    finally:
        package_logger.removeHandler(handler)
    line = next(m for m in messages if "SpecDecoding metrics" in m)
    assert "Mean acceptance length: 2.33" in line and "Avg Draft acceptance rate: 50.0%" in line
    assert "Per-position acceptance rate: 0.667, 0.667, 0.000" in line
