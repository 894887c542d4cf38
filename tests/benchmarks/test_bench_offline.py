"""``fastdeploy bench latency`` / ``bench throughput``: result keys (fast) and real runs (slow, subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fastdeploy.benchmarks.datasets import SampleRequest
from fastdeploy.benchmarks.latency import latency_result
from fastdeploy.benchmarks.throughput import throughput_result

# A small engine: the runs only check that the commands work end to end.
ENGINE_FLAGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", "256M"]


def test_latency_result_keys():
    result = latency_result([1.0, 2.0, 3.0, 4.0])
    assert result["avg_latency"] == 2.5 and result["latencies"] == [1.0, 2.0, 3.0, 4.0]
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert result["percentiles"]["50"] == 2.5


def test_throughput_result_keys():
    result = throughput_result([SampleRequest("a", 10, 5), SampleRequest("b", 30, 5)], 2.0, 10)
    assert result == {"elapsed_time": 2.0, "num_requests": 2, "total_num_tokens": 50, "total_prompt_tokens": 40,
                      "total_output_tokens": 10, "requests_per_second": 1.0, "tokens_per_second": 25.0,
                      "output_tokens_per_second": 5.0}


def run_bench(*argv: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "bench", *argv, *ENGINE_FLAGS],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_latency_run(tmp_path):
    out = run_bench("latency", "--input-len", "16", "--output-len", "4", "--batch-size", "2", "--num-iters-warmup",
                    "1", "--num-iters", "2", "--output-json", str(tmp_path / "l.json"), "--disable-tqdm")
    assert "Avg latency:" in out and "99% percentile latency:" in out
    result = json.loads((tmp_path / "l.json").read_text())
    assert len(result["latencies"]) == 2 and result["avg_latency"] > 0


@pytest.mark.slow
def test_throughput_run(tmp_path):
    out = run_bench("throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "4",
                    "--output-json", str(tmp_path / "t.json"), "--disable-tqdm")
    assert "Throughput:" in out and "output tokens/s" in out
    result = json.loads((tmp_path / "t.json").read_text())
    # ignore_eos: exactly the asked-for output tokens.
    assert result["num_requests"] == 4 and result["total_output_tokens"] == 16 and result["total_prompt_tokens"] == 64
