"""benchmarks/compare_vllm.py: scenario selection, ratios and the markdown table (no server started)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "compare_vllm.py")
_spec = importlib.util.spec_from_file_location("compare_vllm", _PATH)
compare_vllm = importlib.util.module_from_spec(_spec)
# dataclasses look their module up in sys.modules while the module runs.
sys.modules["compare_vllm"] = compare_vllm
_spec.loader.exec_module(compare_vllm)


def test_scenarios():
    args = compare_vllm.parse_args(["--scenarios", "random-c16,random-c1", "--num-prompts", "32",
                                    "--num-prompts-c1", "8"])
    scenarios = compare_vllm.make_scenarios(args)
    assert [(s.name, s.max_concurrency, s.num_prompts) for s in scenarios] == [("random-c16", 16, 32),
                                                                               ("random-c1", 1, 8)]
    bench = scenarios[0].bench_args(256, 128)
    assert bench[bench.index("--random-input-len") + 1] == "256" and "--ignore-eos" in bench
    sharegpt = compare_vllm.Scenario("s", "sharegpt", 16, 4).bench_args(256, 128)
    assert "--ignore-eos" in sharegpt and "--random-input-len" not in sharegpt
    with pytest.raises(SystemExit):
        compare_vllm.make_scenarios(compare_vllm.parse_args(["--scenarios", "nope"]))


def test_ratios_and_table():
    fd = {"completed": 4, "output_throughput": 300.0, "median_ttft_ms": 50.0, "median_tpot_ms": 20.0}
    vl = {"completed": 4, "output_throughput": 150.0, "median_ttft_ms": 100.0, "median_tpot_ms": 40.0}
    ratios = compare_vllm.ratios(fd, vl)
    assert ratios == {"output_throughput": 2.0, "median_ttft_ms": 0.5, "median_tpot_ms": 0.5}
    report = {"comparison": {"random-c16": ratios},
              "servers": {"fastdeploy": {"peak_rss_mib": 900.0, "scenarios": {"random-c16": fd}},
                          "vllm": {"peak_rss_mib": 1800.0, "scenarios": {"random-c16": vl}}}}
    table = compare_vllm.markdown_table(report)
    assert "| random-c16 | fastdeploy | 4 | 300.0 | 50 | 20.0 | 900 |" in table
    assert "| random-c16 | ratio FD/vLLM | | 2.0 | 0.5 | 0.5 | |" in table


def test_peak_rss_of_this_process():
    sampler = compare_vllm.PeakRSS(os.getpid(), interval_s=0.01)
    assert sampler.sample() > 0
    import time

    time.sleep(0.05)
    assert sampler.stop() > 0


def test_servers_do_not_inherit_the_thread_count_fastdeploy_set(monkeypatch):
    """``import fastdeploy`` sets OMP_NUM_THREADS; a server must not take it for the user's choice."""
    import fastdeploy

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(fastdeploy, "USER_SET_OMP_NUM_THREADS", False)
    assert "OMP_NUM_THREADS" not in compare_vllm.server_environment()
    monkeypatch.setattr(fastdeploy, "USER_SET_OMP_NUM_THREADS", True)
    assert compare_vllm.server_environment()["OMP_NUM_THREADS"] == "2"
