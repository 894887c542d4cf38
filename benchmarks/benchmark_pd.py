"""1 prefill + 1 decode instance vs 2 mixed instances behind the router, same client, same run.

Each layout is started in turn on loopback (router + two API servers that register themselves
with ``--router``), and ``fastdeploy bench serve`` drives the router. For the disaggregated
layout the decode instance's ``/metrics`` give the KV-transfer cost: bytes per token and per
request, time per request and its share of the mean TTFT. Each instance gets
``--omp-threads`` OpenMP threads (default 1: the two instances share this machine's cores).

    python benchmarks/benchmark_pd.py                                  # defaults below
    python benchmarks/benchmark_pd.py --input-len 512 --output-len 64 --num-prompts 48 --max-concurrency 8

Writes benchmarks/results/pd_disaggregation.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_vllm import DEFAULT_MODEL_NAME, fastdeploy_command, get_open_port, running_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(ROOT, "benchmarks", "results", "pd_disaggregation.json")
SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", "1G", "--disable-log-stats",
               "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
LAYOUTS = {"1P+1D": ("prefill", "decode"), "2 mixed": ("mixed", "mixed")}


def metrics(port: int) -> dict[str, float]:
    """Every sample on an instance's /metrics, summed over labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30, trust_env=False).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def bench(router_port: int, args: argparse.Namespace, result_dir: str, label: str) -> dict[str, Any]:
    """``fastdeploy bench serve`` against the router; its summary JSON."""
    filename = f"{label.replace(' ', '_').replace('+', '')}.json"
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
           "--host", "127.0.0.1", "--port", str(router_port), "--model", DEFAULT_MODEL_NAME,
           "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency",
           str(args.max_concurrency), "--ignore-eos", "--seed", str(args.seed), "--save-result",
           "--result-dir", result_dir, "--result-filename", filename, "--percentile-metrics", "ttft,tpot,e2el",
           "--label", label]
    print(f"[{label}] {' '.join(cmd[3:])}", flush=True)
    subprocess.check_call(cmd)
    with open(os.path.join(result_dir, filename)) as f:
        result = json.load(f)
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        result.pop(key, None)
    return result


def run_layout(label: str, roles: tuple[str, str], args: argparse.Namespace, log_dir: str) -> dict[str, Any]:
    router_port = get_open_port()
    router_cmd = [sys.executable, "-m", "fastdeploy.router.launch", "--host", "127.0.0.1", "--port",
                  str(router_port), "--policy", "request_num", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.omp_threads)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(running_server(f"{label}-router", router_cmd, env, router_port, log_dir, 60))
        ports = []
        for i, role in enumerate(roles):
            port = get_open_port()
            flags = [*SERVER_ARGS, "--router", f"http://127.0.0.1:{router_port}", "--splitwise-role", role]
            if role != "mixed":
                flags += ["--pd-comm-port", str(get_open_port())]
            stack.enter_context(running_server(f"{label}-{role}{i}", fastdeploy_command(port, flags), env, port,
                                               log_dir, args.timeout))
            ports.append(port)
        deadline = time.monotonic() + 60
        while len(httpx.get(f"http://127.0.0.1:{router_port}/instances", trust_env=False).json()["instances"]) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("the instances did not register with the router")
            time.sleep(0.5)
        bench(router_port, argparse.Namespace(**{**vars(args), "num_prompts": args.warmup_prompts}), log_dir,
              f"{label} warmup")
        before = [metrics(p) for p in ports]
        result = bench(router_port, args, log_dir, label)
        after = [metrics(p) for p in ports]
    if roles == ("prefill", "decode"):
        result["kv_transfer"] = transfer_cost(before[1], after[1], result)
    return result


def transfer_cost(before: dict[str, float], after: dict[str, float], result: dict[str, Any]) -> dict[str, Any]:
    """KV-transfer figures of the decode instance over the measured run."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    requests = delta("fastdeploy:kv_transfer_requests_total")
    nbytes = delta("fastdeploy:kv_transfer_bytes_total")
    seconds = delta("fastdeploy:kv_transfer_seconds_sum")
    prompt_tokens = result["total_input_tokens"]
    mean_ms = 1000 * seconds / requests if requests else None
    return {
        "requests": int(requests),
        "blocks": int(delta("fastdeploy:kv_transfer_blocks_total")),
        "bytes": int(nbytes),
        "bytes_per_token": round(nbytes / prompt_tokens, 1) if prompt_tokens else None,
        "bytes_per_request": round(nbytes / requests) if requests else None,
        "failures": int(delta("fastdeploy:kv_transfer_failures_total")),
        "mean_ms_per_request": round(mean_ms, 2) if mean_ms is not None else None,
        "share_of_mean_ttft": round(mean_ms / result["mean_ttft_ms"], 4) if mean_ms and result["mean_ttft_ms"] else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--warmup-prompts", type=int, default=4)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--omp-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600, help="Seconds a server may take to start.")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    keys = ("completed", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
            "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_e2el_ms")
    report: dict[str, Any] = {
        "benchmark": "pd_disaggregation", "machine": platform.machine(), "cpus": os.cpu_count(),
        "command": "python benchmarks/benchmark_pd.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "workload": {"dataset": "random", "input_len": args.input_len, "output_len": args.output_len,
                     "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                     "omp_threads_per_instance": args.omp_threads},
        "layouts": {},
    }
    with tempfile.TemporaryDirectory(prefix="fd-bench-pd-") as log_dir:
        for label, roles in LAYOUTS.items():
            result = run_layout(label, roles, args, log_dir)
            report["layouts"][label] = {k: result[k] for k in keys if k in result} | (
                {"kv_transfer": result["kv_transfer"]} if "kv_transfer" in result else {})
    pd, mixed = report["layouts"]["1P+1D"], report["layouts"]["2 mixed"]
    report["ratios_pd_over_mixed"] = {k: round(pd[k] / mixed[k], 3) for k in keys[1:] if mixed.get(k)}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
