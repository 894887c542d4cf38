"""The CPU platform (x86-64, Paddle's CPU build)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy.logger import init_logger
from fastdeploy.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig

logger = init_logger(__name__)


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    supported_quantization: list[str] = []

    def is_available(self) -> bool:
        return True

    def resolve_dtype(self, dtype: str) -> str:
        """Resolve "auto" to bfloat16 where a bf16 linear kernel is built for this CPU, else float32.

        Eager Paddle has no bf16 matmul on CPU: bf16 comes from csrc/cpu, on oneDNN with
        AMX-BF16 / AVX512-BF16, or on AVX2 + FMA from the panel kernel with bf16 weights, which
        reads half the bytes of fp32 weights (decode is bound by those reads): measured there,
        a decode step at batch 1 takes 18.5 ms against 31.1 ms in fp32, and a 256-token
        prefill 789 against 817 ms (benchmarks/results/kernels.json).
        """
        if dtype == "float32":
            return "float32"
        if dtype in ("auto", "bfloat16"):
            missing = self.bf16_unavailable_reason()
            if missing is None:
                return "bfloat16"
            if dtype == "auto":
                return "float32"
            raise ValueError(f"dtype='bfloat16' is not available on this CPU build: {missing}. Use --dtype float32.")
        raise ValueError(
            f"dtype={dtype!r} is not supported on CPU (no {dtype} kernels); use --dtype auto, bfloat16 or float32."
        )

    def bf16_unavailable_reason(self) -> str | None:
        """Why bf16 cannot run here, or None when it can (checks the CPU, then builds/finds the kernels)."""
        from fastdeploy import _C

        if _C.bf16_linear_path() is None:
            return "the CPU has neither AMX-BF16, AVX512-BF16 nor AVX2 with FMA"
        so = _C.ensure_built()
        if so is None:
            return f"the C++ kernels are not built ({_C.failure_reason()})"
        missing = _C.manifest().get("onednn_missing")
        return f"the oneDNN linear kernel is missing ({missing})" if missing else None

    def param_dtype(self, dtype: str) -> str:
        # Activations, norms and embeddings stay fp32; bf16 lives in the packed matmul weights and the KV cache.
        return "float32"

    def get_attn_backend_cls(self) -> str:
        return "fastdeploy.model_executor.layers.attention.paged_attention.PagedAttention"

    def kv_cache_bytes(self, fd_config: FDConfig) -> int:
        return fd_config.cache_config.kv_cache_bytes()

    def ignored_flags(self) -> dict[str, str]:
        """Engine flags with no meaning on CPU, each with the reason logged when a user sets one.

        vLLM's CPU backend ignores these too: memory is not profiled (the KV cache is sized
        by --kv-cache-memory-bytes or VLLM_CPU_KVCACHE_SPACE) and nothing is graph-captured.
        """
        return {
            "gpu_memory_utilization": "the CPU KV cache is sized by --kv-cache-memory-bytes, else "
                                      "VLLM_CPU_KVCACHE_SPACE / FD_CPU_KVCACHE_SPACE GiB (as vLLM CPU)",
            "enforce_eager": "the CPU build always runs eagerly (there is no graph capture to turn off)",
            "graph_optimization_config": "there is no CUDA graph capture or graph compilation on CPU",
        }
