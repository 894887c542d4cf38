"""``wint8`` / ``wint4`` (FastDeploy's W8A16 / W4A16): a bf16/fp32 checkpoint quantized when it loads.

``wint8``: per-output-channel symmetric int8. ``wint4``: 4 bits per weight in groups of 128
input rows per output column, each group with its scale and zero point (min/max). The weights
stay integers in memory and are widened to fp32 in registers by ``csrc/cpu/int_gemm.cc``
(fp32 activations, fp32 FMAs); the kernel path is the platform's choice (``FD_CPU_INT_KERNEL``).

The decoder's projections are quantized; the LM head and the embedding stay as the checkpoint
has them (as FastDeploy and vLLM's weight-only formats do).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from fastdeploy.model_executor.layers.quantization import register_quantization_config
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from fastdeploy.model_executor.layers.quantization.int_kernels import (
    KERNEL_PATHS,
    Int4Weight,
    pack_int4,
    pack_int8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int8,
)

DEFAULT_GROUP = 128


def int_kernel_isa(name: str) -> int:
    """The platform's integer-kernel path as the op's isa argument; a RuntimeError naming ``name`` without one."""
    path = get_op_backend().int_gemm
    if path not in KERNEL_PATHS:
        raise RuntimeError(
            f"quantization={name!r} needs the C++ integer kernels (csrc/cpu/int_gemm.cc), which are not available "
            "here (FD_CPU_KERNELS=0, or the kernels did not build: see the warning above)."
        )
    return KERNEL_PATHS[path]


def is_quantized_layer(layer: nn.Layer) -> bool:
    """The layers the integer formats quantize: the decoder's projections, not the LM head."""
    from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead

    return isinstance(layer, LinearBase) and not isinstance(layer, ParallelLMHead)


def refuse_gguf(name: str, model_config: Any) -> None:
    """A ValueError for a GGUF file: formats quantized at load start from a Hugging Face checkpoint."""
    if getattr(model_config, "gguf_file", None):
        raise ValueError(
            f"quantization={name!r} quantizes a bf16/fp32 checkpoint at load; {model_config.model!r} is a GGUF "
            "file (serve it with --quantization gguf, or give the Hugging Face checkpoint)."
        )


class IntLinearMethod(LinearMethodBase):
    """A linear layer whose weight is int8 (per channel) or int4 (per group) in the kernel's panels.

    Subclasses say where the integers come from: :meth:`quantize` turns the loaded fp32
    ``[in, out]`` weight into them (the checkpoint's own integers for AWQ / GPTQ).

    Args:
        bits: 8 or 4.
        group: rows of K per 4-bit scale.
        isa: the kernel path's id (:data:`~.int_kernels.KERNEL_PATHS`).
    """

    def __init__(self, bits: int, group: int, isa: int) -> None:
        self.bits, self.group, self.isa = bits, group, isa

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        UnquantizedLinearMethod.create_weights(self, layer, input_size, output_size, bias, dtype)  # type: ignore[arg-type]

    def quantize(self, layer: LinearBase) -> tuple[np.ndarray, ...]:
        """The packed ``(qweight, scales[, mins])`` of the layer (from its loaded fp32 weight here)."""
        w = layer.weight.numpy()
        if self.bits == 8:
            return pack_int8(*quantize_int8(w))
        return pack_int4(quantize_int4(w, self.group))

    def set_packed(self, layer: LinearBase, packed: tuple[np.ndarray, ...]) -> None:
        """Keep the packed arrays as the layer's buffers and the op's arguments; drop the fp32 weight."""
        names = ("qweight", "scales", "mins")
        tensors = [paddle.to_tensor(a) for a in packed]
        for name, t in zip(names, tensors, strict=False):
            layer.register_buffer(name, t, persistable=True)
        mins = tensors[2] if len(tensors) > 2 else None
        object.__setattr__(layer, "_int_args", (tensors[0], tensors[1], mins, layer.bias, layer.output_size,
                                                self.bits, self.group, self.isa))
        layer.weight = None

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Quantize and pack once; True: the layer computes (in fp32) whatever ``dtype`` is."""
        if getattr(layer, "_int_args", None) is None:
            self.set_packed(layer, self.quantize(layer))
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        return ops.int_linear(x, *layer._int_args)

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        qweight, scales, mins, _, n, bits, group, _ = layer._int_args
        k = layer.input_size
        if bits == 8:
            return paddle.to_tensor(unpack_int8(qweight.numpy(), scales.numpy(), k, n))
        return paddle.to_tensor(unpack_int4(qweight.numpy(), scales.numpy(), mins.numpy(), k, n, group))


class _WeightOnlyConfig(QuantizationConfig):
    """A format quantized at load: the decoder's projections get an :class:`IntLinearMethod`."""

    bits: int = 8

    def __init__(self, group: int = DEFAULT_GROUP) -> None:
        self.group = group
        self.isa = int_kernel_isa(self.get_name())

    def __repr__(self) -> str:
        path = next(name for name, isa in KERNEL_PATHS.items() if isa == self.isa)
        group = f", group={self.group}" if self.bits == 4 else ""
        return f"{type(self).__name__}(bits={self.bits}{group}, kernel_path={path!r})"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _WeightOnlyConfig:
        return cls()

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        refuse_gguf(cls.get_name(), model_config)

    def get_quant_method(self, layer: nn.Layer, prefix: str) -> QuantizeMethodBase | None:
        return IntLinearMethod(self.bits, self.group, self.isa) if is_quantized_layer(layer) else None


@register_quantization_config("wint8")
class WInt8Config(_WeightOnlyConfig):
    """``--quantization wint8``: W8A16, per-channel symmetric int8 weights quantized at load."""

    bits = 8

    @classmethod
    def get_name(cls) -> str:
        return "wint8"


@register_quantization_config("wint4")
class WInt4Config(_WeightOnlyConfig):
    """``--quantization wint4``: W4A16, 4-bit weights in groups of 128 with scales and zero points, quantized at load."""

    bits = 4

    @classmethod
    def get_name(cls) -> str:
        return "wint4"


__all__ = ["Int4Weight", "IntLinearMethod", "WInt4Config", "WInt8Config", "int_kernel_isa", "is_quantized_layer", "refuse_gguf"]
