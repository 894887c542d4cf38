"""``wint8`` / ``wint4`` (FastDeploy's W8A16 / W4A16): a bf16/fp32 checkpoint quantized when it loads.

``wint8``: per-output-channel symmetric int8. ``wint4``: 4 bits per weight in groups of 128
input rows per output column, each group with its scale and zero point (min/max). The weights
stay integers in memory; the kernel path is the platform's choice (``FD_CPU_INT_KERNEL``):

- ``onednn`` (CPUs with AVX512-BF16 or AMX, on request: faster prefill, much slower decode): oneDNN's weight-decompression matmul
  (csrc/cpu/linear.cc), bf16 activations times s8 weights widened to bf16 inside its brgemm
  kernel. A 4-bit weight is held there as the s8 ``q - zero`` (one byte, like wint8): oneDNN
  3.6 (Paddle's libdnnl) runs s4/u4 weights, and grouped zero points, only in its reference
  code on CPUs without AMX (hundreds of times slower).
- ``avx512`` / ``avx2`` / ``scalar`` (the default): csrc/cpu/int_gemm.cc widens the weights to fp32 in
  registers (fp32 activations and FMAs); wint4 keeps two weights a byte there.

The decoder's projections are quantized; the LM head and the embedding stay as the checkpoint
has them (as FastDeploy and vLLM's weight-only formats do).
"""

from __future__ import annotations

from typing import Any

import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from fastdeploy.model_executor.layers.quantization import register_quantization_config
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from fastdeploy.model_executor.layers.quantization.int_kernels import (
    KERNEL_PATHS,
    ONEDNN_MIN_GROUP,
    ONEDNN_PATH,
    Int4Weight,
    Int8Weight,
    onednn_group,
    onednn_operands,
    pack_int4,
    pack_int8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
    unpack_int8,
)

logger = init_logger(__name__)

DEFAULT_GROUP = 128
# wint4's range shrink factors tried per group at load (the least squared error wins): see quantize_int4.
INT4_SHRINKS = (1.0,)


def int_kernel_path(name: str) -> str:
    """The platform's integer-kernel path (``onednn`` or one of int_gemm.cc's); a RuntimeError naming ``name`` without one."""
    path = get_op_backend().int_gemm
    if path != ONEDNN_PATH and path not in KERNEL_PATHS:
        raise RuntimeError(
            f"quantization={name!r} needs the C++ integer kernels (csrc/cpu/int_gemm.cc), which are not available "
            "here (FD_CPU_KERNELS=0, or the kernels did not build: see the warning above)."
        )
    return path


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
    """A linear layer whose weight is int8 (per channel) or int4 (per group), packed for the platform's kernel.

    Subclasses say where the integers come from: :meth:`quantize` turns the loaded fp32
    ``[in, out]`` weight into them (the checkpoint's own integers for AWQ / GPTQ).

    Args:
        bits: 8 or 4.
        group: rows of K per 4-bit scale.
        path: the platform's integer-kernel path: ``onednn`` (oneDNN's weight-decompression
            matmul, csrc/cpu/linear.cc) or an int_gemm.cc path (:data:`~.int_kernels.KERNEL_PATHS`).
    """

    def __init__(self, bits: int, group: int, path: str) -> None:
        self.bits, self.group, self.path = bits, group, path

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        UnquantizedLinearMethod.create_weights(self, layer, input_size, output_size, bias, dtype)  # type: ignore[arg-type]

    def quantize(self, layer: LinearBase) -> Int8Weight | Int4Weight:
        """The layer's integer weight (from its loaded fp32 weight here)."""
        w = layer.weight.numpy()
        return quantize_int8(w) if self.bits == 8 else quantize_int4(w, self.group, INT4_SHRINKS)

    def set_packed(self, layer: LinearBase, weight: Int8Weight | Int4Weight) -> None:
        """Pack ``weight`` for the kernel, keep it as the layer's buffers and the op's arguments; drop the fp32 weight."""
        k = weight.q.shape[0]
        group = onednn_group(k, weight) if self.path == ONEDNN_PATH else None
        if group is not None:
            q, scales = onednn_operands(weight, group)
            tensors = [ops.weight_only_pack(paddle.to_tensor(q), group), paddle.to_tensor(scales)]
            args: tuple[Any, ...] = ("onednn", tensors[0], tensors[1], layer.bias, layer.output_size, group)
        else:
            if self.path == ONEDNN_PATH:  # a group too fine for oneDNN: AVX-512's int_gemm (onednn implies it)
                logger.info("%s [%d, %d] int%d group %d: int_gemm avx512 (oneDNN needs whole groups of >= %d rows)",
                            type(layer).__name__, k, layer.output_size, self.bits, self.group, ONEDNN_MIN_GROUP)
            packed = pack_int8(*weight) if isinstance(weight, Int8Weight) else pack_int4(weight)
            tensors = [paddle.to_tensor(a) for a in packed]
            mins = tensors[2] if len(tensors) > 2 else None
            isa = KERNEL_PATHS["avx512" if self.path == ONEDNN_PATH else self.path]
            args = ("int_gemm", tensors[0], tensors[1], mins, layer.bias, layer.output_size, self.bits, self.group, isa)
        for name, t in zip(("qweight", "scales", "mins"), tensors, strict=False):
            layer.register_buffer(name, t, persistable=True)
        object.__setattr__(layer, "_int_args", args)
        # The integers themselves, for dense_weight (oneDNN's blocked layout is not read back).
        object.__setattr__(layer, "_int_weight", weight if group is not None else None)
        layer.weight = None

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Quantize and pack once; True: the layer computes (in fp32) whatever ``dtype`` is."""
        if getattr(layer, "_int_args", None) is None:
            self.set_packed(layer, self.quantize(layer))
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        kind, *args = layer._int_args
        return ops.weight_only_linear(x, *args) if kind == "onednn" else ops.int_linear(x, *args)

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        if layer._int_weight is not None:
            return paddle.to_tensor(layer._int_weight.dequantize())
        _, qweight, scales, mins, _, n, bits, group, _ = layer._int_args
        k = layer.input_size
        if bits == 8:
            return paddle.to_tensor(unpack_int8(qweight.numpy(), scales.numpy(), k, n))
        return paddle.to_tensor(unpack_int4(qweight.numpy(), scales.numpy(), mins.numpy(), k, n, group))


class _WeightOnlyConfig(QuantizationConfig):
    """A format quantized at load: the decoder's projections get an :class:`IntLinearMethod`."""

    bits: int = 8

    def __init__(self, group: int = DEFAULT_GROUP) -> None:
        self.group = group
        self.path = int_kernel_path(self.get_name())

    def __repr__(self) -> str:
        group = f", group={self.group}" if self.bits == 4 else ""
        return f"{type(self).__name__}(bits={self.bits}{group}, kernel_path={self.path!r})"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _WeightOnlyConfig:
        return cls()

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        refuse_gguf(cls.get_name(), model_config)

    def get_quant_method(self, layer: nn.Layer, prefix: str) -> QuantizeMethodBase | None:
        return IntLinearMethod(self.bits, self.group, self.path) if is_quantized_layer(layer) else None


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


__all__ = ["Int4Weight", "IntLinearMethod", "WInt4Config", "WInt8Config", "int_kernel_path", "is_quantized_layer", "refuse_gguf"]
