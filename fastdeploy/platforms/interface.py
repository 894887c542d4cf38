"""The Platform interface: every device-specific decision lives behind it."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig


class PlatformEnum(enum.Enum):
    CPU = enum.auto()
    CUDA = enum.auto()
    XPU = enum.auto()
    UNSPECIFIED = enum.auto()


class Platform:
    """Base class of the accelerators FastDeploy can run on."""

    _enum: PlatformEnum = PlatformEnum.UNSPECIFIED
    device_name: str = "unspecified"
    # Paddle's device string for paddle.set_device.
    device_type: str = "cpu"
    dist_backend: str = "gloo"
    supported_quantization: list[str] = []

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

    def get_attn_backend_cls(self) -> str:
        """Dotted path of the attention backend class."""
        raise NotImplementedError

    def kv_cache_bytes(self, fd_config: FDConfig) -> int:
        """Bytes the KV cache may take."""
        raise NotImplementedError

    def check_and_update_config(self, fd_config: FDConfig) -> None:
        """Validate and adjust the config for this platform (dtype, quantization, ...)."""
        quant = fd_config.model_config.quantization
        if quant is not None and quant not in self.supported_quantization:
            raise ValueError(
                f"quantization={quant!r} is not supported on {self.device_name}; "
                f"supported: {self.supported_quantization or 'none yet'}."
            )
        fd_config.model_config.dtype = self.resolve_dtype(fd_config.model_config.dtype)

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
