"""Every environment variable FastDeploy reads, in one place.

FD_PLATFORM             force the platform ("cpu", "cuda", ...) instead of detecting it.
FD_CPU_KVCACHE_SPACE    KV cache size in GiB on CPU (default 4); VLLM_CPU_KVCACHE_SPACE is honoured too.
FD_LOGGING_LEVEL        log level of the fastdeploy logger (default INFO); VLLM_LOGGING_LEVEL too.
FD_API_KEY              API key of the server; VLLM_API_KEY too.
FD_DEFAULT_MODEL        path of the model used when none is given (default: the embedded SmolLM2).
FD_CACHE_ROOT           where converted artefacts and the built C++ kernels are cached (default ~/.cache/fastdeploy).
FD_CPU_KERNELS          "0" turns the C++ kernels (csrc/cpu) off: plain Paddle ops, float32 only (default "1").
FD_CPU_GGUF_KERNEL      the block-kernel path of --quantization gguf: "auto" (default: the best this CPU runs,
                        amx-int8 > avx512-vnni > avx2 > scalar) or one of them by name; a path the CPU cannot run
                        is refused.
FD_CPU_INT_KERNEL       the kernel path of the integer formats (--quantization wint8, wint4, w8a8, awq, gptq):
                        "auto" (default: the best this CPU runs, avx512-bf16 > avx512 > avx2 > scalar;
                        avx512-bf16 rounds a bf16 model's activations to bf16 for bf16 dot products; onednn,
                        oneDNN's weight-decompression matmul on AVX512-BF16/AMX for the weight-only formats, on request)
                        or one of them by name; "scalar" also runs w8a8 in portable C++ instead of oneDNN. A path the CPU cannot run is refused.
FD_CPU_FP8_KERNEL       the kernel path of --quantization fp8: "auto" (default: the best this CPU runs, amx-bf16 >
                        avx512-bf16 for bf16 models, else avx512 > avx2 > scalar in fp32) or one of them by name; a
                        path the CPU cannot run is refused.
FD_CPU_ATTENTION_KERNEL the paged-attention path: "auto" (default: the best this CPU runs, amx-bf16 > avx512-bf16 >
                        the build's fp32 path avx512 / avx2 / scalar) or one of them by name; avx512-bf16 multiplies
                        bf16 KV caches with bf16 dot products, amx-bf16 takes their scores from AMX tiles (fp32
                        caches always take the fp32 path).
FD_CPU_ATTENTION_PREFETCH where the attention kernels fetch the KV-cache rows they read next: "auto" (default: L2
                        on AMD CPUs, L1 on the others), "l1" or "l2".
FD_CPU_HUGE_PAGES       "0" keeps the weights in 4 KB pages; by default (1) a model's weights (from 16 MB) move to 2 MB
                        transparent huge pages where the kernel offers them (fastdeploy/platforms/huge_pages.py).
FD_CPU_OMP_THREADS_BIND which cores the engine process computes on: "auto" (default: its own cores when it has
                        fewer threads than there are cores, the API process keeps the rest), "nobind", or a core
                        list such as "1" or "2-3"; VLLM_CPU_OMP_THREADS_BIND too (fastdeploy/platforms/cpu_binding.py).
FD_CPU_WIDE_STEP_TOKENS when the engine is pinned to fewer cores than the server may use: a step of at least
                        this many tokens (a prefill) computes on every core while the CPU is otherwise free
                        (default 128; 0 keeps every step on the engine's cores; fastdeploy/platforms/cpu_binding.py).
FD_CPU_OVERSUBSCRIBE    "1": start more tensor-/data-parallel ranks than the CPU cores this process may use (ranks
                        then share cores; default "0": such a -tp/-dp is refused at start-up).
FD_KV_TRANSFER_TIMEOUT  seconds a prefill instance keeps a request's KV blocks for its decode instance, and a
                        decode instance waits for them (default 120); VLLM_NIXL_ABORT_REQUEST_TIMEOUT too.
FD_MAX_N_SEQUENCES      the largest ``n`` / beam width a request may ask for (default 16384);
                        VLLM_MAX_N_SEQUENCES too.
FD_MAX_NUM_BAD_WORDS    the most ``bad_words`` a request may give (default 128); VLLM_MAX_NUM_BAD_WORDS too.
FD_IMAGE_FETCH_TIMEOUT  seconds an http(s) image URL may take to download (default 5); VLLM_IMAGE_FETCH_TIMEOUT too.
FD_MEDIA_MAX_BYTES      the largest media download accepted, in bytes (default 50 MiB).

Variables of other tools that FastDeploy reads:

OMP_NUM_THREADS         compute threads. ``import fastdeploy`` sets it, before Paddle is imported (Paddle would
                        force 1), to the cores this process may run on unless the user set it; the API server
                        then gives the engine process one core less (fastdeploy/engine/core_client.py).
CXX                     the C++ compiler that builds csrc/cpu (default ``c++``).
PYTHONPATH              kept, after the source tree, for the process that builds the kernels.
OPENAI_API_KEY          API key of ``fastdeploy chat|complete`` and ``fastdeploy bench serve`` (a client's key).

Outside this module the package reads no environment variable (tests/test_envs.py checks it); it may set
some for its own child processes, through :func:`child_environment` or :func:`environment_with`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


def _first(*names: str, default: str | None = None) -> str | None:
    """The value of the first of ``names`` that is set and not empty, else ``default``."""
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return default


def platform_override() -> str | None:
    """FD_PLATFORM: the platform to use instead of detecting one (None: detect)."""
    return _first("FD_PLATFORM")


def cpu_kvcache_space_gib() -> float:
    """FD_CPU_KVCACHE_SPACE (or VLLM_CPU_KVCACHE_SPACE): KV cache GiB on CPU (4), positive."""
    value = _first("FD_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE", default="4")
    try:
        space = float(value)
    except ValueError as e:
        raise ValueError(f"FD_CPU_KVCACHE_SPACE must be a number of GiB, got {value!r}.") from e
    if space <= 0:
        raise ValueError(f"FD_CPU_KVCACHE_SPACE must be positive, got {value!r}.")
    return space


def logging_level() -> str:
    """FD_LOGGING_LEVEL (or VLLM_LOGGING_LEVEL): the fastdeploy logger's level, upper case (INFO)."""
    return (_first("FD_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL", default="INFO") or "INFO").upper()


def api_key() -> str | None:
    """FD_API_KEY (or VLLM_API_KEY): the key the server requires (None: no key)."""
    return _first("FD_API_KEY", "VLLM_API_KEY")


def default_model() -> str | None:
    """FD_DEFAULT_MODEL: the model used when none is given (None: the embedded SmolLM2)."""
    return _first("FD_DEFAULT_MODEL")


def cache_root() -> str:
    """FD_CACHE_ROOT: where converted artefacts and built kernels are cached (~/.cache/fastdeploy)."""
    return _first("FD_CACHE_ROOT", default=os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy"))


def cpu_kernels_enabled() -> bool:
    """FD_CPU_KERNELS: False when set to 0/false/off (plain Paddle ops instead of csrc/cpu)."""
    return _first("FD_CPU_KERNELS", default="1") not in ("0", "false", "False", "off")


def cpu_huge_pages_enabled() -> bool:
    """FD_CPU_HUGE_PAGES: False when set to 0/false/off (weights stay in 4 KB pages)."""
    return _first("FD_CPU_HUGE_PAGES", default="1") not in ("0", "false", "False", "off")


def _kernel_path(name: str, paths: tuple[str, ...]) -> str:
    """A kernel-path variable: "auto" (the default) or one of ``paths``."""
    value = _first(name, default="auto") or "auto"
    if value not in ("auto", *paths):
        raise ValueError(f"{name} must be auto, {', '.join(paths[:-1])} or {paths[-1]}, got {value!r}.")
    return value


def cpu_gguf_kernel() -> str:
    """FD_CPU_GGUF_KERNEL: the GGUF block-kernel path ("auto", "amx-int8", "avx512-vnni", "avx2" or "scalar")."""
    return _kernel_path("FD_CPU_GGUF_KERNEL", ("amx-int8", "avx512-vnni", "avx2", "scalar"))


def cpu_int_kernel() -> str:
    """FD_CPU_INT_KERNEL: the integer-format kernel path ("auto", "amx-bf16", "avx512-bf16", "onednn", "avx512", "avx2"
    or "scalar")."""
    return _kernel_path("FD_CPU_INT_KERNEL", ("amx-bf16", "avx512-bf16", "onednn", "avx512", "avx2", "scalar"))


def cpu_fp8_kernel() -> str:
    """FD_CPU_FP8_KERNEL: the fp8-weight kernel path ("auto", "amx-bf16", "avx512-bf16", "avx512", "avx2" or "scalar")."""
    return _kernel_path("FD_CPU_FP8_KERNEL", ("amx-bf16", "avx512-bf16", "avx512", "avx2", "scalar"))


def cpu_attention_kernel() -> str:
    """FD_CPU_ATTENTION_KERNEL: the paged-attention path ("auto", "amx-bf16", "avx512-bf16", "avx512", "avx2" or
    "scalar")."""
    return _kernel_path("FD_CPU_ATTENTION_KERNEL", ("amx-bf16", "avx512-bf16", "avx512", "avx2", "scalar"))


def cpu_attention_prefetch() -> str:
    """FD_CPU_ATTENTION_PREFETCH: where the attention kernels fetch the cache rows ahead ("auto", "l1" or "l2")."""
    return _kernel_path("FD_CPU_ATTENTION_PREFETCH", ("l1", "l2"))


def cpu_wide_step_tokens() -> int:
    """FD_CPU_WIDE_STEP_TOKENS: steps of this many tokens compute on every core while the CPU is free (128)."""
    return _int("FD_CPU_WIDE_STEP_TOKENS", default=128)


def cpu_omp_threads_bind() -> str:
    """FD_CPU_OMP_THREADS_BIND (or VLLM_CPU_OMP_THREADS_BIND): the engine's cores (auto)."""
    return _first("FD_CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND", default="auto") or "auto"


def cpu_oversubscribe() -> bool:
    """FD_CPU_OVERSUBSCRIBE: "1" lets more tensor/data-parallel ranks start than there are CPU cores (they share)."""
    return (_first("FD_CPU_OVERSUBSCRIBE", default="0") or "0").strip().lower() in ("1", "true", "yes")


def kv_transfer_timeout_s() -> float:
    """FD_KV_TRANSFER_TIMEOUT (or VLLM_NIXL_ABORT_REQUEST_TIMEOUT): PD KV hand-off seconds (120)."""
    value = _first("FD_KV_TRANSFER_TIMEOUT", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", default="120")
    try:
        timeout = float(value)
    except ValueError as e:
        raise ValueError(f"FD_KV_TRANSFER_TIMEOUT must be a number of seconds, got {value!r}.") from e
    if timeout <= 0:
        raise ValueError(f"FD_KV_TRANSFER_TIMEOUT must be positive, got {value!r}.")
    return timeout


def _int(*names: str, default: int) -> int:
    """The first of ``names`` that is set, as an integer (FastDeploy's name first, vLLM's honoured too)."""
    for name in names:
        value = _first(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {value!r}.") from None
    return default


def max_n_sequences() -> int:
    """FD_MAX_N_SEQUENCES (or VLLM_MAX_N_SEQUENCES): the largest ``n`` / beam width of a request (16384)."""
    return _int("FD_MAX_N_SEQUENCES", "VLLM_MAX_N_SEQUENCES", default=16384)


def max_num_bad_words() -> int:
    """FD_MAX_NUM_BAD_WORDS (or VLLM_MAX_NUM_BAD_WORDS): the most ``bad_words`` of a request (128)."""
    return _int("FD_MAX_NUM_BAD_WORDS", "VLLM_MAX_NUM_BAD_WORDS", default=128)


def image_fetch_timeout() -> float:
    """FD_IMAGE_FETCH_TIMEOUT (or VLLM_IMAGE_FETCH_TIMEOUT): seconds to download an image URL (5)."""
    return float(_first("FD_IMAGE_FETCH_TIMEOUT", "VLLM_IMAGE_FETCH_TIMEOUT", default="5"))


def media_max_bytes() -> int:
    """FD_MEDIA_MAX_BYTES: the largest media download accepted (50 MiB)."""
    return _int("FD_MEDIA_MAX_BYTES", default=50 << 20)


def omp_num_threads() -> str | None:
    """OMP_NUM_THREADS as it is now (None when unset; set by ``import fastdeploy`` unless the user did)."""
    return os.environ.get("OMP_NUM_THREADS")


def default_omp_num_threads() -> int:
    """The OMP_NUM_THREADS ``import fastdeploy`` sets when the user did not: the cores this process may use."""
    return len(os.sched_getaffinity(0))


def cxx() -> str:
    """CXX: the C++ compiler that builds the kernels (default ``c++``)."""
    return _first("CXX", default="c++") or "c++"


def python_path() -> str | None:
    """PYTHONPATH of this process (the kernel build keeps it after the source tree)."""
    return _first("PYTHONPATH")


def openai_api_key(default: str | None = None) -> str | None:
    """OPENAI_API_KEY: the key the CLI's OpenAI clients send (``chat``, ``complete``, ``bench serve``)."""
    return _first("OPENAI_API_KEY", default=default)


def reported_variables(prefixes: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, value) of every set variable whose name starts with one of ``prefixes``, sorted by name.

    For ``fastdeploy collect-env``: secrets (names with KEY or TOKEN) are left out.
    """
    return [(name, os.environ[name]) for name in sorted(os.environ)
            if name.startswith(prefixes) and "KEY" not in name and "TOKEN" not in name]


def environment_with(overrides: Mapping[str, str]) -> dict[str, str]:
    """A copy of this process's environment with ``overrides``: the ``env`` of a subprocess."""
    return {**os.environ, **overrides}


@contextlib.contextmanager
def child_environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set ``overrides`` for a child started inside the block (spawn copies os.environ); restored after."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
