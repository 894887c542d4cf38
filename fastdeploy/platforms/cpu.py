"""The CPU platform (x86-64, Paddle's CPU build).

Which kernel path runs is decided here, once per process (:meth:`CpuPlatform.get_op_backend`),
from the CPU's flags and the C++ kernels that were built for it; layers are handed that
choice when they are built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy import envs
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_features import (  # noqa: F401 - the platform's CPU facts, importable from here
    bf16_linear_path,
    cpu_features,
    cpu_flags,
    cpu_has_avx2_fma,
    cpu_has_avx512,
    cpu_has_bf16,
    cpu_isa,
    cpuinfo,
)
from fastdeploy.platforms.huge_pages import thp_mode
from fastdeploy.platforms.interface import PADDLE_ATTN_BACKEND, OpBackend, Platform, PlatformEnum

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig

logger = init_logger(__name__)

# The CPU-attention implementation on our paged-attention kernels.
CPU_ATTN_BACKEND = "fastdeploy.model_executor.layers.attention.cpu_attn.CpuPagedAttentionImpl"
def _paddle_fused_rms_norm_works() -> bool:
    """Whether Paddle's fused_rms_norm has a CPU kernel here (F.rms_norm has none on CPU).

    Its CPU kernel is built for AVX-512 and dies with SIGILL on an AVX2-only CPU, which no
    try/except can catch: without AVX-512 it is not even tried.
    """
    if not cpu_has_avx512():
        return False
    try:
        import paddle
        from paddle.incubate.nn.functional import fused_rms_norm

        fused_rms_norm(paddle.ones([1, 4]), paddle.ones([4]), None, 1e-6, 1)
        return True
    except Exception:  # noqa: BLE001 - a missing kernel shows up as ImportError/RuntimeError/NotFound
        return False


def gguf_kernel_paths() -> list[str]:
    """The GGUF block-kernel paths this CPU can run, best first: AMX-INT8 tiles for whole 16-row tiles
    (``tdpbsud``; the other rows, and steps of fewer rows, on VNNI registers, with the same bits), integer
    dot products on AVX512-VNNI (``vpdpbusd``), on AVX2 (``vpmaddubsw``), plain C++."""
    flags = cpu_flags()
    paths = ["avx512-vnni"] if {"avx512_vnni", "avx512bw", "avx512vl"} <= flags else []
    paths = (["amx-int8"] if paths and {"amx_tile", "amx_int8"} <= flags else []) + paths
    return paths + (["avx2"] if cpu_has_avx2_fma() and "f16c" in flags else []) + ["scalar"]


def gguf_kernel_path() -> str:
    """The GGUF block-kernel path: FD_CPU_GGUF_KERNEL when set, else the best this CPU runs.

    Raises:
        ValueError: FD_CPU_GGUF_KERNEL names a path this CPU cannot run.
    """
    return _chosen_path("FD_CPU_GGUF_KERNEL", envs.cpu_gguf_kernel(), gguf_kernel_paths())


def _bf16_pair_paths(flags: frozenset[str]) -> list[str]:
    """The bf16 paths of csrc/cpu/pair_gemm_impl.h's GEMM (int_gemm.cc, fp8_gemm.cc) this CPU runs, best
    first: AMX tiles, then AVX512-BF16 registers (which AMX CPUs also have)."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags:
        return []
    return (["amx-bf16"] if {"amx_tile", "amx_bf16"} <= flags else []) + ["avx512-bf16"]


def int_kernel_paths() -> list[str]:
    """The integer-weight kernel paths this CPU can run, best first.

    csrc/cpu/int_gemm.cc's bf16 products first, on AMX tiles (``amx-bf16``: a prefill or a batch of 16 rows
    runs 4-7x faster than on registers, measured on a Sapphire Rapids core) then AVX512-BF16 registers
    (``vdpbf16ps``) (a bf16 model's layers; an fp32 model keeps fp32 activations on the next), its AVX-512 fp32
    path, then ``onednn``: oneDNN's weight-decompression matmul
    (csrc/cpu/linear.cc), bf16 activations on AVX512-BF16 / AMX units (without them oneDNN 3.6 runs
    it in its reference code, hundreds of times slower), then int_gemm's AVX2 and plain C++. oneDNN
    is opt-in (``FD_CPU_INT_KERNEL=onednn``): measured on an AVX512-BF16 EPYC (no AMX), one thread,
    SmolLM2-135M wint8, it prefills 256 tokens in 324 ms against int_gemm's 587, but a one-sequence
    decode step takes 135 ms against 16 (it widens every weight at every call, whatever the rows).
    """
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw"} <= flags
    paths = _bf16_pair_paths(flags) + (["avx512"] if avx512 else [])
    paths += ["onednn"] if avx512 and flags & {"avx512_bf16", "amx_bf16"} else []
    return paths + (["avx2"] if cpu_has_avx2_fma() else []) + ["scalar"]


def int_kernel_path() -> str:
    """The integer-weight kernel path: FD_CPU_INT_KERNEL when set, else the best this CPU runs.

    Raises:
        ValueError: FD_CPU_INT_KERNEL names a path this CPU cannot run.
    """
    return _chosen_path("FD_CPU_INT_KERNEL", envs.cpu_int_kernel(), int_kernel_paths())


def fp8_kernel_paths() -> list[str]:
    """The fp8-weight kernel paths this CPU can run, best first (csrc/cpu/fp8_gemm.cc): bf16 products on AMX
    tiles, bf16 dot products (``vdpbf16ps``) on AVX512-BF16, fp32 FMAs on AVX-512, on AVX2 (with F16C), plain C++."""
    flags = cpu_flags()
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    paths = _bf16_pair_paths(flags) + (["avx512"] if avx512 else [])
    return paths + (["avx2"] if cpu_has_avx2_fma() and "f16c" in flags else []) + ["scalar"]


def fp8_kernel_path() -> str:
    """The fp8-weight kernel path: FD_CPU_FP8_KERNEL when set, else the best this CPU runs.

    Raises:
        ValueError: FD_CPU_FP8_KERNEL names a path this CPU cannot run.
    """
    return _chosen_path("FD_CPU_FP8_KERNEL", envs.cpu_fp8_kernel(), fp8_kernel_paths())


def attention_kernel_paths() -> list[str]:
    """The paged-attention paths this CPU can run, best first (csrc/cpu/attention*.cc): bf16 KV caches
    with the scores on AMX tiles and the rest on AVX512-BF16 dot products (``amx-bf16``), or all on the
    dot products (``vdpbf16ps``, ``avx512-bf16``; attention_bf16.cc), then the build's fp32 path
    (AVX-512 or AVX2 registers, or plain C++), which also serves every fp32 cache."""
    flags = cpu_flags()
    bf16 = _bf16_pair_paths(flags) if "avx512dq" in flags else []  # attention_bf16.cc also uses AVX512-DQ
    return bf16 + ["avx512" if cpu_has_avx512() else "avx2" if cpu_has_avx2_fma() else "scalar"]


def attention_kernel_path() -> str:
    """The paged-attention path: FD_CPU_ATTENTION_KERNEL when set, else the best this CPU runs.

    Raises:
        ValueError: FD_CPU_ATTENTION_KERNEL names a path this CPU cannot run.
    """
    return _chosen_path("FD_CPU_ATTENTION_KERNEL", envs.cpu_attention_kernel(), attention_kernel_paths())


def attention_prefetch_level(attention_path: str | None) -> str:
    """Where the attention kernels on ``attention_path`` (None: plain Paddle's) fetch the KV-cache rows they read
    next: FD_CPU_ATTENTION_PREFETCH when set, else ``l2`` on AMD CPUs and ``l1`` on the others; ``l1`` (the
    setting is moot, and a set one draws a warning) on Paddle's and the plain-C++ path, which prefetch nothing.

    A decode's keys sit in scattered 6 KB blocks and each row is read once. On a Zen 4 EPYC, fetching them
    into L2 made 16 decodes over 330 and 1,000 tokens, streamed over 30 layers' caches, 1.5-1.8x faster than
    into L1; on Sapphire Rapids L2 was the same or slower.
    """
    wanted = envs.cpu_attention_prefetch()
    if attention_path in (None, "scalar"):
        if wanted != "auto":
            logger.warning("FD_CPU_ATTENTION_PREFETCH=%s does nothing: the attention runs on %s, which prefetches "
                           "no rows.", wanted, f"the {attention_path} kernel path" if attention_path else "Paddle")
        return "l1"
    if wanted != "auto":
        return wanted
    return "l2" if cpuinfo("vendor_id") == "AuthenticAMD" else "l1"


def int_kernel_choice(built: set[str]) -> str:
    """The integer-weight path for the op backend: :func:`int_kernel_path`; where oneDNN was asked
    for and the kernels were built without it (no fd_weight_only_linear), an error under
    FD_CPU_INT_KERNEL=onednn, else (a platform that lists it first) the next path."""
    path = int_kernel_path()
    if path == "onednn" and "fd_weight_only_linear" not in built:
        if envs.cpu_int_kernel() == "onednn":
            raise ValueError("FD_CPU_INT_KERNEL=onednn: the kernels were built without oneDNN (csrc/cpu/linear.cc).")
        path = next(p for p in int_kernel_paths() if p != "onednn")
        logger.info("wint8/wint4/awq/gptq: oneDNN's kernels are not built; csrc/cpu/int_gemm.cc runs them (%s).", path)
    return path


def _chosen_path(variable: str, wanted: str, paths: list[str]) -> str:
    """``wanted`` (an override read from ``variable``) if this CPU runs it, the best of ``paths`` for "auto"."""
    if wanted == "auto":
        return paths[0]
    if wanted not in paths:
        raise ValueError(f"{variable}={wanted} cannot run on this CPU; it runs: {', '.join(paths)}.")
    return wanted


def onednn_w8a8_weight_max() -> int:
    """The largest |int8 weight| oneDNN's u8 x s8 matmul multiplies exactly on this CPU.

    Without VNNI oneDNN multiplies with ``vpmaddubsw``, whose int16 pair sums saturate for 8-bit
    activations times 8-bit weights: the weights keep 7 bits there.
    """
    return 127 if cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"} else 63


def w8a8_kernel(built: set[str]) -> tuple[str, int]:
    """(W8A8 path, largest |int8 weight|): oneDNN's int8 matmul where it was built (jit-compiled for
    AVX2 and AVX-512), portable C++ under FD_CPU_INT_KERNEL=scalar or without oneDNN."""
    if "fd_w8a8_linear" in built and int_kernel_path() != "scalar":
        return "onednn", onednn_w8a8_weight_max()
    return ("scalar", 127) if "fd_w8a8_linear_portable" in built else ("paddle", 127)


class CpuPlatform(Platform):
    _enum = PlatformEnum.CPU
    device_name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    # FastDeploy's GPU-only formats: refused by name, never emulated on a slower path.
    unsupported_quantization: dict[str, str] = {
        "w4a8": "W4A8 (int4 weights x int8 activations) runs on FastDeploy's GPU tensor-core GEMMs only; "
                "no CPU kernel is built for it",
        "w4afp8": "W4AFP8 computes with FP8 activations, and these CPUs have no FP8 arithmetic",
        "wint2": "W2A16 (wint2) runs on FastDeploy's GPU 2-bit weight kernels only; no CPU kernel is built for it",
        "w2a16": "W2A16 (FastDeploy's wint2) runs on GPU 2-bit weight kernels only; no CPU kernel is built for it",
        "block_wise_fp8": "FastDeploy's block-wise FP8 computes with FP8 activations, and these CPUs have no FP8 "
                          "arithmetic; --quantization fp8 serves e4m3 weights (block-wise scales included) widened "
                          "in the kernel",
        "wfp8afp8": "W8A8 FP8 computes with FP8 activations, and these CPUs have no FP8 arithmetic; --quantization "
                    "fp8 serves e4m3 weights widened in the kernel",
        "awq_marlin": "Marlin kernels run on NVIDIA GPUs only; --quantization awq serves the same AWQ checkpoints "
                      "on CPU (their config.json selects it without -q)",
        "gptq_marlin": "Marlin kernels run on NVIDIA GPUs only; --quantization gptq serves the same GPTQ checkpoints "
                       "on CPU (their config.json selects it without -q)",
        # The name config.json carries; its fp8 form (float-quantized, strategy "channel") is the one asked for.
        "compressed-tensors": "compressed-tensors checkpoints (fp8 float-quantized per channel, int8 W8A8) have no "
                              "loader here; fp8 checkpoints in vLLM's Fp8Config form (quant_method 'fp8': per-tensor "
                              "weight_scale or block-wise weight_scale_inv) are served with --quantization fp8",
    }

    @property
    def supported_quantization(self) -> list[str]:  # type: ignore[override]
        """Every registered ``--quantization`` method (each one's kernels are checked when it is built)."""
        from fastdeploy.model_executor.layers.quantization import get_quantization_methods

        return get_quantization_methods()

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
        if dtype == "float16":
            # vLLM's CPU backend computes in fp16; Paddle's CPU build has no fp16 kernels at all (not even
            # add or matmul), so fp16 cannot be computed here, and computing in another dtype instead
            # would not be what was asked for.
            raise ValueError("dtype='float16' is not supported on CPU: Paddle's CPU build has no float16 kernels "
                             "(not even add or matmul). Use --dtype auto, bfloat16 or float32.")
        raise ValueError(
            f"dtype={dtype!r} is not supported on CPU (no {dtype} kernels); use --dtype auto, bfloat16 or float32."
        )

    def bf16_unavailable_reason(self) -> str | None:
        """Why bf16 cannot run here, or None when it can (checks the CPU, then builds/finds the kernels)."""
        from fastdeploy import _C

        if bf16_linear_path() is None:
            return "the CPU has neither AMX-BF16, AVX512-BF16 nor AVX2 with FMA"
        so = _C.ensure_built()
        if so is None:
            return f"the C++ kernels are not built ({_C.failure_reason()})"
        missing = _C.manifest().get("onednn_missing")
        return f"the oneDNN linear kernel is missing ({missing})" if missing else None

    def quantization_unavailable_reason(self, name: str) -> str | None:
        """``gguf`` needs the block kernels (csrc/cpu/gguf_gemm.cc) built; checked at start-up, before the worker.

        Raises:
            ValueError: FD_CPU_GGUF_KERNEL names a path this CPU cannot run.
        """
        if name != "gguf":
            return None
        from fastdeploy import _C

        if _C.ensure_built() is None:
            return f"the C++ block kernels (csrc/cpu/gguf_gemm.cc) are not built ({_C.failure_reason()})"
        if "gguf_gemm.cc" not in _C.manifest().get("sources", []):
            return "the C++ kernels were built without the block kernels (csrc/cpu/gguf_gemm.cc)"
        gguf_kernel_path()
        return None

    def param_dtype(self, dtype: str) -> str:
        # Activations, norms and embeddings stay fp32; bf16 lives in the packed matmul weights and the KV cache.
        return "float32"

    _op_backend: OpBackend | None = None

    def get_attn_backend_cls(self) -> str:
        """Our paged-attention kernels where they were built, else the plain-Paddle implementation."""
        from fastdeploy import _C

        built = {"fd_paged_attention", "fd_rope_and_cache"} <= _C.load()
        return CPU_ATTN_BACKEND if built else PADDLE_ATTN_BACKEND

    def get_op_backend(self) -> OpBackend:
        """Our kernels where they were built for this CPU (and FD_CPU_KERNELS is not 0), else plain Paddle.

        Building or loading the kernels happens here, once per process; a failure has already
        been logged by :func:`fastdeploy._C.load` and leaves the plain-Paddle backend.
        """
        if self._op_backend is None:
            from fastdeploy import _C

            built = _C.load()
            attn_backend_cls = self.get_attn_backend_cls()
            attention_path = attention_kernel_path() if attn_backend_cls == CPU_ATTN_BACKEND else None
            w8a8, w8a8_weight_max = w8a8_kernel(built)
            self._op_backend = OpBackend(
                # linear.cc builds the panel kernel on AVX2 CPUs without bf16 units, oneDNN elsewhere.
                linear=("panel" if bf16_linear_path() == "panel" else "onednn") if "fd_linear" in built else "paddle",
                rms_norm="csrc" if {"fd_rms_norm", "fd_fused_add_rms_norm"} <= built else "paddle",
                paddle_fused_rms_norm=_paddle_fused_rms_norm_works(),
                silu_and_mul="csrc" if "fd_silu_and_mul" in built else "paddle",
                attention=f"paged-{attention_path}" if attention_path else "paddle",
                attention_prefetch=attention_prefetch_level(attention_path),
                attn_backend_cls=attn_backend_cls,
                # Its expert weights are packed by fd_linear_pack: only with the linear kernel.
                fused_moe="csrc" if {"fd_fused_moe", "fd_linear"} <= built else "paddle",
                moe_routing="csrc" if "fd_select_experts" in built else "paddle",
                decoder_layer="fd_decoder_layers" in built,
                isa=cpu_isa() if built else "",
                gguf=gguf_kernel_path() if {"fd_gguf_linear", "fd_gguf_embedding"} <= built else "paddle",
                int_gemm=int_kernel_choice(built) if "fd_int_linear" in built else "paddle",
                w8a8=w8a8,
                w8a8_weight_max=w8a8_weight_max,
                fp8=fp8_kernel_path() if "fd_fp8_linear" in built else "paddle",
                sampler="csrc" if {"fd_exp_scaled", "fd_inverse_cdf_sample", "fd_sample_random"} <= built else "numpy",
                huge_pages=envs.cpu_huge_pages_enabled() and thp_mode() in ("always", "madvise"),
            )
        return self._op_backend

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
