"""Every environment variable FastDeploy reads, in one place.

FD_PLATFORM             force the platform ("cpu", "cuda", ...) instead of detecting it.
FD_CPU_KVCACHE_SPACE    KV cache size in GiB on CPU (default 4); VLLM_CPU_KVCACHE_SPACE is honoured too.
FD_LOGGING_LEVEL        log level of the fastdeploy logger (default INFO); VLLM_LOGGING_LEVEL too.
FD_API_KEY              API key of the server; VLLM_API_KEY too.
FD_DEFAULT_MODEL        path of the model used when none is given (default: the embedded SmolLM2).
FD_CACHE_ROOT           where converted artefacts and the built C++ kernels are cached (default ~/.cache/fastdeploy).
FD_CPU_KERNELS          "0" turns the C++ kernels (csrc/cpu) off: plain Paddle ops, float32 only (default "1").
FD_CPU_OMP_THREADS_BIND which cores the engine process computes on: "auto" (default: its own cores when it has
                        fewer threads than there are cores, the API process keeps the rest), "nobind", or a core
                        list such as "1" or "2-3"; VLLM_CPU_OMP_THREADS_BIND too (fastdeploy/platforms/cpu_binding.py).
FD_KV_TRANSFER_TIMEOUT  seconds a prefill instance keeps a request's KV blocks for its decode instance, and a
                        decode instance waits for them (default 120); VLLM_NIXL_ABORT_REQUEST_TIMEOUT too.
"""

from __future__ import annotations

import os


def _first(*names: str, default: str | None = None) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return default


def platform_override() -> str | None:
    return _first("FD_PLATFORM")


def cpu_kvcache_space_gib() -> float:
    value = _first("FD_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE", default="4")
    try:
        space = float(value)
    except ValueError as e:
        raise ValueError(f"FD_CPU_KVCACHE_SPACE must be a number of GiB, got {value!r}.") from e
    if space <= 0:
        raise ValueError(f"FD_CPU_KVCACHE_SPACE must be positive, got {value!r}.")
    return space


def logging_level() -> str:
    return (_first("FD_LOGGING_LEVEL", "VLLM_LOGGING_LEVEL", default="INFO") or "INFO").upper()


def api_key() -> str | None:
    return _first("FD_API_KEY", "VLLM_API_KEY")


def default_model() -> str | None:
    return _first("FD_DEFAULT_MODEL")


def cache_root() -> str:
    return _first("FD_CACHE_ROOT", default=os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy"))


def cpu_kernels_enabled() -> bool:
    return _first("FD_CPU_KERNELS", default="1") not in ("0", "false", "False", "off")


def cpu_omp_threads_bind() -> str:
    return _first("FD_CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND", default="auto") or "auto"


def kv_transfer_timeout_s() -> float:
    value = _first("FD_KV_TRANSFER_TIMEOUT", "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", default="120")
    try:
        timeout = float(value)
    except ValueError as e:
        raise ValueError(f"FD_KV_TRANSFER_TIMEOUT must be a number of seconds, got {value!r}.") from e
    if timeout <= 0:
        raise ValueError(f"FD_KV_TRANSFER_TIMEOUT must be positive, got {value!r}.")
    return timeout
