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
        # Eager Paddle has no bf16/fp16 matmul on CPU; the csrc kernels bring bf16.
        if dtype in ("auto", "float32"):
            return "float32"
        raise ValueError(
            f"dtype={dtype!r} is not supported on CPU in this build (Paddle has no {dtype} matmul "
            "kernel on CPU); use --dtype float32 or auto."
        )

    def get_attn_backend_cls(self) -> str:
        return "fastdeploy.model_executor.layers.attention.paged_attention.PagedAttention"

    def kv_cache_bytes(self, fd_config: FDConfig) -> int:
        return fd_config.cache_config.kv_cache_bytes()
