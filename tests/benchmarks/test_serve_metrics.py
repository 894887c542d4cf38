"""``bench serve`` metrics: vLLM's TTFT/TPOT/ITL/E2EL definitions, percentiles, table and JSON keys."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fastdeploy.benchmarks.datasets import SampleRequest
from fastdeploy.benchmarks.endpoint_request_func import RequestFuncOutput
from fastdeploy.benchmarks.serve import (
    calculate_metrics,
    get_request,
    metrics_to_result,
    percentile_word,
    print_results,
    summarize_ms,
)


def output(start: float, ttft: float, itl: list[float], tokens: int, text: str = "x") -> RequestFuncOutput:
    return RequestFuncOutput(generated_text=text, success=True, latency=ttft + sum(itl), output_tokens=tokens,
                             ttft=ttft, itl=itl, start_time=start)


class _NoTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()


@pytest.fixture
def run():
    requests = [SampleRequest("a", 10, 4), SampleRequest("b", 20, 4), SampleRequest("c", 30, 4)]
    outputs = [
        output(0.0, 0.1, [0.2, 0.2, 0.2], tokens=4),  # TPOT (0.7 - 0.1) / 3 = 0.2
        output(0.0, 0.3, [0.1, 0.5], tokens=5),  # chunks != tokens: TPOT (0.9 - 0.3) / 4 = 0.15
        RequestFuncOutput(success=False, error="boom", start_time=0.0),
    ]
    return requests, outputs


def test_definitions(run):
    requests, outputs = run
    metrics, output_lens = calculate_metrics(requests, outputs, 2.0, _NoTokenizer(), ["ttft", "tpot", "itl", "e2el"],
                                             [50, 99], bench_start=0.0)
    assert metrics.completed == 2 and metrics.failed == 1
    # Input tokens count only successful requests; failed ones count 0 output tokens.
    assert metrics.total_input == 30 and metrics.total_output == 9 and output_lens == [4, 5, 0]
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.output_throughput == pytest.approx(4.5)
    assert metrics.total_token_throughput == pytest.approx(19.5)
    stats = metrics.stats_ms
    assert stats["ttft"]["mean"] == pytest.approx(200) and stats["ttft"]["median"] == pytest.approx(200)
    assert stats["tpot"]["mean"] == pytest.approx(175)
    # ITL pools every gap of every request.
    assert stats["itl"]["mean"] == pytest.approx(np.mean([200, 200, 200, 100, 500]))
    assert stats["itl"]["median"] == pytest.approx(200)
    assert stats["e2el"]["mean"] == pytest.approx(800)
    assert stats["itl"]["p99"] == pytest.approx(np.percentile([200, 200, 200, 100, 500], 99))
    assert stats["tpot"]["p50"] == pytest.approx(175)


def test_usage_missing_counts_text_tokens_and_single_token_has_no_tpot():
    requests = [SampleRequest("a", 1, 1), SampleRequest("b", 1, 3)]
    outputs = [output(0.0, 0.1, [], tokens=0, text="one"), output(0.0, 0.1, [0.1, 0.1], tokens=0, text="a b c")]
    metrics, lens = calculate_metrics(requests, outputs, 1.0, _NoTokenizer(), ["tpot"], [99], bench_start=0.0)
    assert lens == [1, 3]
    assert metrics.stats_ms["tpot"]["mean"] == pytest.approx(100)  # only the 3-token request has a TPOT


def test_peak_rates():
    requests = [SampleRequest("a", 1, 3)] * 2
    outputs = [output(0.0, 0.1, [0.1, 0.1], tokens=3), output(0.05, 0.1, [1.0, 0.1], tokens=3)]
    metrics, _ = calculate_metrics(requests, outputs, 2.0, _NoTokenizer(), ["ttft"], [99], bench_start=0.0)
    # Second 0 holds tokens at 0.1, 0.2, 0.3 and 0.15; second 1 holds 1.15 and 1.25.
    assert metrics.max_output_tokens_per_s == 4 and metrics.max_concurrent_requests == 2


def test_empty_lists_give_zeros():
    stats = summarize_ms([], [99, 99.9])
    assert stats == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0, "p99.9": 0.0}
    assert percentile_word(99.0) == "99" and percentile_word(99.9) == "99.9"


def test_result_keys_and_table(run, capsys):
    requests, outputs = run
    metrics, lens = calculate_metrics(requests, outputs, 2.0, _NoTokenizer(), ["ttft", "tpot", "itl"], [99],
                                      bench_start=0.0)
    result = metrics_to_result(metrics, 2.0, outputs, requests, lens)
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "ttfts", "itls", "errors"):
        assert key in result, key
    assert "mean_e2el_ms" not in result
    print_results(metrics, 2.0, 16, float("inf"), ["ttft", "tpot", "itl"], [99])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "Successful requests:                     2         "
    assert "Failed requests:                         1         " in lines
    assert "Maximum request concurrency:             16        " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert any(line.startswith("Median TPOT (ms):") and "175.00" in line for line in lines)
    assert any(line.startswith("P99 ITL (ms):") for line in lines)
    assert lines[-1] == "=" * 50


def _arrival_times(rate: float, burstiness: float, n: int = 200) -> list[float]:
    import time

    async def collect() -> list[float]:
        times = []
        async for _ in get_request([SampleRequest("p", 1, 1)] * n, rate, burstiness, seed=0):
            times.append(time.perf_counter())
        return times

    return asyncio.run(collect())


def test_request_rate_and_burstiness():
    times = _arrival_times(float("inf"), 1.0)
    assert times[-1] - times[0] < 0.05
    # 200 Poisson arrivals at 2000/s take about 0.1 s (sleep granularity makes it a bit longer).
    span = _arrival_times(2000.0, 1.0)
    assert 0.05 < span[-1] - span[0] < 1.0
    with pytest.raises(ValueError, match="burstiness"):
        _arrival_times(1.0, 0.0, n=1)
