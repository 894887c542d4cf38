"""The one reader of the CPU's features (/proc/cpuinfo), for the platform and the kernels' build key.

It imports nothing of FastDeploy: :mod:`fastdeploy._C` keys its builds on these flags and the CPU
platform asks ``_C`` which kernels were built, so neither may import the other's importer.
"""

from __future__ import annotations

import platform
from functools import cache

# The extensions that decide which kernels run, in the order collect-env lists them.
_FEATURES_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8",
                         "amx_tile")


@cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's ``key : value`` lines of /proc/cpuinfo (empty where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block is enough: the cores of one machine agree
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpuinfo(key: str) -> str | None:
    """One field of /proc/cpuinfo (``"model name"``, ``"flags"``, ...), None when absent."""
    return _cpuinfo().get(key)


def cpu_flags_line() -> str:
    """The CPU's feature flags as /proc/cpuinfo spells them (part of the kernels' build key)."""
    return cpuinfo("flags") or platform.processor()


@cache
def cpu_flags() -> frozenset[str]:
    return frozenset(cpu_flags_line().split())


def cpu_has_avx512() -> bool:
    """Whether the CPU has AVX-512 (Paddle's fused CPU kernels such as fused_rms_norm assume it)."""
    return "avx512f" in cpu_flags()


def cpu_has_bf16() -> bool:
    """Whether the CPU computes bf16 dot products natively (AMX-BF16 or AVX512-BF16)."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


def bf16_linear_path() -> str | None:
    """Which kernel runs bf16 linears on this CPU: "onednn" (AMX / AVX512-BF16), "panel" (AVX2 + FMA:
    bf16 weights widened in registers, csrc/cpu/panel_gemm.cc) or None (no fast bf16 here)."""
    if cpu_has_bf16():
        return "onednn"
    return "panel" if cpu_has_avx2_fma() else None


def cpu_features() -> str:
    """The CPU extensions that decide which kernels run (AVX2, AVX-512, bf16 and AMX units)."""
    return " ".join(flag for flag in _FEATURES_OF_INTEREST if flag in cpu_flags()) or "none of interest"


def cpu_isa() -> str:
    """The widest instruction set the kernels use here, for logs."""
    flags = cpu_flags()
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX512-BF16"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if cpu_has_avx2_fma() else "x86-64"
