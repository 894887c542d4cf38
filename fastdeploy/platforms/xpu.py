"""The Kunlun XPU platform: declared, not built in this installation yet."""

from fastdeploy.platforms.interface import PlatformEnum, UnbuiltPlatform


class XpuPlatform(UnbuiltPlatform):
    _enum = PlatformEnum.XPU
    device_name = "xpu"
    device_type = "xpu"
    dist_backend = "bkcl"
