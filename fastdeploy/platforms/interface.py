"""The Platform interface: every device-specific decision lives behind it."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig


class PlatformEnum(enum.Enum):
    CPU = enum.auto()
    CUDA = enum.auto()
    XPU = enum.auto()
    UNSPECIFIED = enum.auto()


# The plain-Paddle attention implementation, which every platform can run.
PADDLE_ATTN_BACKEND = "fastdeploy.model_executor.layers.attention.paddle_attn.PaddleAttentionImpl"
# Added to the attention ops' attn_isa: the KV-cache rows a kernel reads next are fetched into L2, not L1
# (csrc/cpu/kernels.h's kAttentionPrefetchL2).
ATTN_PREFETCH_L2 = 8


@dataclass(frozen=True)
class OpBackend:
    """Which implementation each layer runs, chosen once by the platform at start-up.

    Layers read it when they are built (:func:`fastdeploy.model_executor.custom_op.get_op_backend`)
    and keep to it; nothing probes the hardware per call. The default is plain Paddle ops
    everywhere, which every platform can run (``FD_CPU_KERNELS=0`` gives that).
    """

    # Matmul weights: "onednn" (packed for oneDNN), "panel" (csrc/cpu/panel_gemm.cc) or "paddle" (paddle.matmul).
    linear: str = "paddle"
    # "csrc" (fd_rms_norm / fd_fused_add_rms_norm) or "paddle".
    rms_norm: str = "paddle"
    # Whether Paddle's own fused_rms_norm has a kernel here (used by the plain-Paddle norms).
    paddle_fused_rms_norm: bool = False
    # "csrc" (fd_silu_and_mul) or "paddle" (F.swiglu).
    silu_and_mul: str = "paddle"
    # Attention backend: the kernel path ("paged-amx-bf16", "paged-avx512-bf16", "paged-avx512", "paged-avx2", "paged-scalar")
    # or "paddle", and the class layers build.
    attention: str = "paddle"
    attn_backend_cls: str = PADDLE_ATTN_BACKEND
    # Mixture-of-experts layers: "csrc" (fd_fused_moe on packed expert weights) or "paddle" (a matmul per expert).
    fused_moe: str = "paddle"
    # MoE routing (softmax / sigmoid top-k, correction bias, expert groups): "csrc" (fd_select_experts, one op
    # per layer and step) or "paddle" (router.py's Paddle ops).
    moe_routing: str = "paddle"
    # Whether whole Llama-style decoder layers run in one kernel (fd_decoder_layers) once their weights are packed.
    decoder_layer: bool = False
    # The instruction set the kernels were built for, for logs ("AVX512-BF16", "AVX2", ...).
    isa: str = ""
    # GGUF block kernels (--quantization gguf, csrc/cpu/gguf_gemm.cc): "amx-int8", "avx512-vnni", "avx2", "scalar"
    # or "paddle" (not built: the format is refused).
    gguf: str = "paddle"
    # Integer weight kernels (wint8 / wint4 / awq / gptq): "onednn" (csrc/cpu/linear.cc's weight
    # decompression), or csrc/cpu/int_gemm.cc's "amx-bf16", "avx512-bf16", "avx512", "avx2", "scalar"
    # or "paddle" (not built: the formats are refused).
    int_gemm: str = "paddle"
    # W8A8: "onednn" (oneDNN's int8 matmul, csrc/cpu/linear.cc), "scalar" (portable C++) or "paddle" (refused);
    # w8a8_weight_max: the largest |int8 weight|, 63 where the CPU has no VNNI (vpmaddubsw saturates int16).
    w8a8: str = "paddle"
    w8a8_weight_max: int = 127
    # fp8 (e4m3) weight kernels (--quantization fp8, csrc/cpu/fp8_gemm.cc): "amx-bf16", "avx512-bf16", "avx512",
    # "avx2", "scalar" or "paddle" (not built: the format is refused). The bf16 paths serve bf16 models only.
    fp8: str = "paddle"
    # Random sampling's full-vocabulary passes (temperature + exp, inverse-CDF draw): "csrc"
    # (csrc/cpu/sampling.cc) or "numpy".
    sampler: str = "numpy"
    # Whether the loaded weights move to 2 MB transparent huge pages (platforms/huge_pages.py).
    huge_pages: bool = False
    # Where the attention kernels fetch the KV-cache rows they read next: "l1" or "l2".
    attention_prefetch: str = "l1"

    @property
    def attn_isa(self) -> int:
        """The attention ops' ``attn_isa`` argument: 1 multiplies bf16 caches with bf16 dot products, 2 the same
        with the scores on AMX tiles, 0 in fp32; plus ``ATTN_PREFETCH_L2`` where the rows go to L2."""
        path = {"paged-avx512-bf16": 1, "paged-amx-bf16": 2}.get(self.attention, 0)
        return path + (ATTN_PREFETCH_L2 if self.attention_prefetch == "l2" else 0)

    def uses_kernel(self, op: str) -> bool:
        """Whether the layer family ``op`` ("linear", "rms_norm", "silu_and_mul", "attention", "fused_moe",
        "moe_routing", ...) runs our kernel."""
        return getattr(self, op) != "paddle"

    def describe(self, dtype: str = "float32") -> str:
        """One line for the start-up log and ``collect-env``, e.g. ``linear: panel-bf16 (AVX2), attention: ...``."""
        short = {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
        linear = "paddle-fp32" if self.linear == "paddle" else f"{self.linear}-{short}"
        isa = f" ({self.isa})" if self.isa else ""
        norm = self.rms_norm if self.rms_norm != "paddle" or not self.paddle_fused_rms_norm else "paddle-fused"
        layer = "fused" if self.decoder_layer else "per-op"
        attention = f"{self.attention} (L2 prefetch)" if self.attention_prefetch == "l2" else self.attention
        return (f"linear: {linear}{isa}, attention: {attention}, rms_norm: {norm}, "
                f"silu_and_mul: {self.silu_and_mul}, fused_moe: {self.fused_moe} (routing: {self.moe_routing}), "
                f"decoder layer: {layer}, "
                f"sampler: {self.sampler}, gguf: {self.gguf}, huge pages: {'on' if self.huge_pages else 'off'}")


class Platform:
    """Base class of the accelerators FastDeploy can run on."""

    _enum: PlatformEnum = PlatformEnum.UNSPECIFIED
    device_name: str = "unspecified"
    # Paddle's device string for paddle.set_device.
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    # The --quantization names this platform serves (each must also be registered in
    # model_executor/layers/quantization); the ones it knows but has no instructions for, with why.
    supported_quantization: list[str] = []
    unsupported_quantization: dict[str, str] = {}

    def is_cpu(self) -> bool:
        return self._enum == PlatformEnum.CPU

    def is_cuda(self) -> bool:
        return self._enum == PlatformEnum.CUDA

    def is_available(self) -> bool:
        """Whether this machine can run the platform at all."""
        raise NotImplementedError

    def set_device(self) -> None:
        import paddle

        paddle.set_device(self.device_type)

    def resolve_dtype(self, dtype: str) -> str:
        """Map the requested dtype ("auto" included) to the compute dtype this platform runs."""
        raise NotImplementedError

    def param_dtype(self, dtype: str) -> str:
        """Dtype model parameters and activations are created in for the compute dtype ``dtype``."""
        return dtype

    def get_op_backend(self) -> OpBackend:
        """The kernels layers run on this platform (decided once per process)."""
        return OpBackend(attn_backend_cls=self.get_attn_backend_cls())

    def get_attn_backend_cls(self) -> str:
        """Dotted path of the attention implementation :class:`PagedAttention` builds on this platform."""
        return PADDLE_ATTN_BACKEND

    def kv_cache_bytes(self, fd_config: FDConfig) -> int:
        """Bytes the KV cache may take."""
        raise NotImplementedError

    def check_and_update_config(self, fd_config: FDConfig) -> None:
        """Validate and adjust the config for this platform (dtype, quantization, ...)."""
        from fastdeploy.model_executor.layers.quantization.selection import select_quantization

        select_quantization(fd_config, self)
        fd_config.model_config.dtype = self.resolve_dtype(fd_config.model_config.dtype)

    def quantization_unavailable_reason(self, name: str) -> str | None:
        """Why the supported method ``name`` cannot run in this installation (kernels not built...), or None."""
        del name
        return None

    def ignored_flags(self) -> dict[str, str]:
        """Engine flags (EngineArgs field names) that have no meaning on this platform, with why.

        Setting one to a non-default value logs one warning at start-up (EngineArgs).
        """
        return {}


class UnbuiltPlatform(Platform):
    """A platform FastDeploy knows about but does not build on this machine yet."""

    def is_available(self) -> bool:
        return False

    def _unbuilt(self) -> RuntimeError:
        return RuntimeError(
            f"The {self.device_name} platform is declared but not built in this FastDeploy "
            "installation yet; run on CPU (FD_PLATFORM=cpu)."
        )

    def check_and_update_config(self, fd_config: FDConfig) -> None:
        raise self._unbuilt()

    def set_device(self) -> None:
        raise self._unbuilt()
