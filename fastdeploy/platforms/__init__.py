"""``current_platform``: resolved once, from FD_PLATFORM or by detection."""

from __future__ import annotations

from fastdeploy import envs
from fastdeploy.platforms.cpu import CpuPlatform
from fastdeploy.platforms.cuda import CudaPlatform
from fastdeploy.platforms.interface import Platform, PlatformEnum
from fastdeploy.platforms.xpu import XpuPlatform

_PLATFORMS: dict[str, type[Platform]] = {
    "cpu": CpuPlatform,
    "cuda": CudaPlatform,
    "gpu": CudaPlatform,
    "xpu": XpuPlatform,
}


def resolve_platform(name: str | None = None) -> Platform:
    """The platform named by ``name`` (or FD_PLATFORM), else the one detected on this machine."""
    name = name or envs.platform_override()
    if name:
        key = name.lower()
        if key not in _PLATFORMS:
            raise ValueError(f"Unknown platform {name!r} (FD_PLATFORM); known: {sorted(set(_PLATFORMS))}.")
        return _PLATFORMS[key]()
    cuda = CudaPlatform()
    # CUDA is only detected when paddle sees a device; it then fails clearly until it is built.
    return cuda if cuda.is_available() else CpuPlatform()


current_platform: Platform = resolve_platform()

__all__ = ["Platform", "PlatformEnum", "current_platform", "resolve_platform"]
