"""The CUDA platform: declared, not built in this installation yet."""

from fastdeploy.platforms.interface import PlatformEnum, UnbuiltPlatform


class CudaPlatform(UnbuiltPlatform):
    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "gpu"
    dist_backend = "nccl"

    def is_available(self) -> bool:
        try:
            import paddle

            return paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
        except Exception:  # noqa: BLE001 - any failure means no usable CUDA
            return False
