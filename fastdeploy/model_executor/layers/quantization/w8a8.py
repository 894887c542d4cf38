"""``w8a8``: int8 weights per output channel, activations quantized per token to u8 at every call.

vLLM CPU serves this form of compressed-tensors checkpoints (dynamic per-token activation
scales, its asymmetric input scheme: a scale and a zero point per token); here a bf16/fp32
checkpoint is quantized when it loads. A token's row ``x`` becomes ``q = round(x / s) + z`` in
0..255 with ``s = (hi - lo) / 255``, ``z = round(-lo / s)`` (``lo``/``hi`` the row's min/max, widened
to hold 0), and ``y = s * ws * (q @ qw - z * sum_k qw)`` with the weights' column sums computed at
load (``csrc/cpu/w8a8.cc``). Against symmetric int8 activations this halves the rounding step of
rows whose range is lopsided. The matmul is oneDNN's u8 x s8 matmul (``csrc/cpu/linear.cc``: VNNI
``vpdpbusd`` where the CPU has it, else AVX2 ``vpmaddubsw``, with int32 sums), or portable C++
under ``FD_CPU_INT_KERNEL=scalar``. Without VNNI the weights keep 7 bits (the platform's
``w8a8_weight_max``): ``vpmaddubsw`` adds pairs of u8 x s8 products in int16, which 8-bit
activations times 8-bit weights would overflow (255 * 63 * 2 < 2^15 does not).

Every row's result is exact integer sums times its own scales: independent of the batch.
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
from fastdeploy.model_executor.layers.quantization.int_kernels import quantize_int8
from fastdeploy.model_executor.layers.quantization.weight_only import is_quantized_layer, refuse_gguf


class W8A8LinearMethod(LinearMethodBase):
    """A linear layer with int8 weights and per-token asymmetric u8 activations.

    Args:
        path: "onednn" or "scalar" (the platform's ``OpBackend.w8a8``).
        weight_max: the largest ``|q|`` of a weight (127, or 63 without VNNI).
    """

    def __init__(self, path: str, weight_max: int) -> None:
        self.path, self.weight_max = path, weight_max

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        UnquantizedLinearMethod.create_weights(self, layer, input_size, output_size, bias, dtype)  # type: ignore[arg-type]

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Quantize the loaded weight once (and reorder it for oneDNN); True: computes whatever ``dtype`` is."""
        if getattr(layer, "_w8a8_args", None) is not None:
            return True
        q, scales = quantize_int8(layer.weight.numpy(), self.weight_max)
        wscale = paddle.to_tensor(scales)
        wsum = paddle.to_tensor(q.sum(axis=0, dtype=np.int32))  # the zero points' correction, once
        if self.path == "onednn":
            weight = ops.w8a8_pack(paddle.to_tensor(q))
        else:
            weight = paddle.to_tensor(np.ascontiguousarray(q.T))
        layer.register_buffer("qweight", weight, persistable=True)
        layer.register_buffer("weight_scale", wscale, persistable=True)
        layer.register_buffer("weight_sum", wsum, persistable=True)
        object.__setattr__(layer, "_w8a8_q", q)  # [K, N] int8, for dense_weight
        object.__setattr__(layer, "_w8a8_args", (weight, wscale, wsum, layer.bias))
        layer.weight = None
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        weight, wscale, wsum, bias = layer._w8a8_args
        if self.path == "onednn":
            return ops.w8a8_linear(x, weight, wscale, wsum, bias, layer.output_size)
        return ops.w8a8_linear_portable(x, weight, wscale, wsum, bias)

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        """The dequantized ``[in, out]`` weight (the activations' rounding is not in it)."""
        return paddle.to_tensor(layer._w8a8_q.astype(np.float32) * layer._w8a8_args[1].numpy())


@register_quantization_config("w8a8")
class W8A8Config(QuantizationConfig):
    """``--quantization w8a8``: per-channel int8 weights quantized at load, dynamic per-token u8 activations.

    Raises:
        RuntimeError: neither oneDNN's int8 matmul nor the portable kernel is built here.
    """

    def __init__(self) -> None:
        backend = get_op_backend()
        if backend.w8a8 not in ("onednn", "scalar"):
            raise RuntimeError(
                "quantization='w8a8' needs the C++ kernels (csrc/cpu/linear.cc, int_gemm.cc), which are not "
                "available here (FD_CPU_KERNELS=0, or the kernels did not build: see the warning above)."
            )
        self.path, self.weight_max = backend.w8a8, backend.w8a8_weight_max

    def __repr__(self) -> str:
        return f"W8A8Config(kernel_path={self.path!r}, weight_bits={8 if self.weight_max == 127 else 7})"

    @classmethod
    def get_name(cls) -> str:
        return "w8a8"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> W8A8Config:
        return cls()

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        refuse_gguf(cls.get_name(), model_config)

    def get_quant_method(self, layer: nn.Layer, prefix: str) -> QuantizeMethodBase | None:
        return W8A8LinearMethod(self.path, self.weight_max) if is_quantized_layer(layer) else None
