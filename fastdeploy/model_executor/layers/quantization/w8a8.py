"""``w8a8``: int8 weights, activations quantized per token to u8 at every call, both in groups of K.

vLLM CPU serves this form of compressed-tensors checkpoints (dynamic per-token activation
scales, its asymmetric input scheme: a scale and a zero point per token); here a bf16/fp32
checkpoint is quantized when it loads, and K (the input features) is cut evenly into groups of
at most ``W8A8_MAX_GROUP`` columns, each with its own scales. A token's group ``x`` becomes
``q = round(x / s) + z`` in 0..255 with ``s = (hi - lo) / 255``, ``z = round(-lo / s)`` (``lo``/``hi``
the group's min/max, widened to hold 0); the weights are symmetric int8 per (group, output
column), and ``y = sum_g s_g * ws_g * (q_g @ qw_g - z_g * sum_k qw_g)`` with each group's column sums
computed at load (``csrc/cpu/w8a8.cc``). One scale per whole row let the SwiGLU outliers that
down_proj reads coarsen every other value of the row: on SmolLM2-135M that cost +1.4% perplexity
against bf16, groups of at most 768 columns bring it to +0.6% (README). The matmul is oneDNN's u8 x s8 matmul
batched over the groups (``csrc/cpu/linear.cc``: VNNI ``vpdpbusd`` where the CPU has it, else AVX2
``vpmaddubsw``, with int32 sums), or portable C++ under ``FD_CPU_INT_KERNEL=scalar``. Without VNNI
the weights keep 7 bits (the platform's ``w8a8_weight_max``): ``vpmaddubsw`` adds pairs of u8 x s8
products in int16, which 8-bit activations times 8-bit weights would overflow (255 * 63 * 2 < 2^15
does not).

Every row's result is exact integer sums times its own scales, added in a fixed order: independent
of the batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.linear import KernelWeight, LinearBase, LinearMethodBase, UnquantizedLinearMethod
from fastdeploy.model_executor.layers.quantization import register_quantization_config
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from fastdeploy.model_executor.layers.quantization.int_kernels import quantize_int8
from fastdeploy.model_executor.layers.quantization.weight_only import is_quantized_layer, refuse_gguf

# The most columns of K per activation / weight scale. A layer's K is split evenly into that many
# groups (rounded up to W8A8_GROUP_ALIGN columns): SmolLM2-135M's 576 stays one group, its 1536
# (down_proj, whose SwiGLU inputs carry the outliers) becomes 2 x 768. Measured on it with
# benchmarks/benchmark_perplexity.py (perplexity vs bf16, 8,176 ShareGPT tokens): one group +1.42%,
# at most 768 +0.61%, 512 +0.67%, 256 +0.20%, 128 +0.31%. Each group's int32 sums are written and
# scaled separately, which prefill pays for: at one thread (benchmark_kernels.py --child, two
# interleaved runs) a 256-token prefill is 1.24-1.27x faster than bf16 with this split against
# 1.27-1.34x with one group and 1.09-1.14x with groups of 256.
W8A8_MAX_GROUP = 768
W8A8_GROUP_ALIGN = 32


def w8a8_group(k: int, max_group: int = W8A8_MAX_GROUP) -> int:
    """Columns per group for ``k`` input features: the even split into ``ceil(k / max_group)`` groups."""
    size = math.ceil(k / math.ceil(k / max_group))
    return min(k, math.ceil(size / W8A8_GROUP_ALIGN) * W8A8_GROUP_ALIGN)


def quantize_int8_groups(w: np.ndarray, group: int, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of ``w [K, N]`` with a scale per (group of ``group`` rows, column): ``(q [K, N], scales [G, N])``.

    The last group may be part-filled (``G = ceil(K / group)``); ``qmax`` bounds ``|q|`` as in :func:`quantize_int8`.
    """
    k = w.shape[0]
    pieces = [quantize_int8(w[i : i + group], qmax) for i in range(0, k, group)]
    return np.concatenate([p.q for p in pieces]), np.stack([p.scales for p in pieces])


def group_sums(q: np.ndarray, group: int) -> np.ndarray:
    """Each group's column sums of int8 ``q [K, N]``: ``[G, N]`` int32 (the zero points' correction)."""
    return np.stack([q[i : i + group].sum(axis=0, dtype=np.int32) for i in range(0, q.shape[0], group)])


class W8A8LinearMethod(LinearMethodBase):
    """A linear layer with int8 weights and per-token asymmetric u8 activations.

    Args:
        path: "onednn" or "scalar" (the platform's ``OpBackend.w8a8``).
        weight_max: the largest ``|q|`` of a weight (127, or 63 without VNNI).
        max_group: the most columns of K per scale (see :func:`w8a8_group`).
    """

    def __init__(self, path: str, weight_max: int, max_group: int = W8A8_MAX_GROUP) -> None:
        self.path, self.weight_max, self.max_group = path, weight_max, max_group

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        UnquantizedLinearMethod.create_weights(self, layer, input_size, output_size, bias, dtype)  # type: ignore[arg-type]

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Quantize the loaded weight once (and reorder it for oneDNN); True: computes whatever ``dtype`` is."""
        if getattr(layer, "_w8a8_args", None) is not None:
            return True
        w = layer.weight.numpy()
        group = w8a8_group(w.shape[0], self.max_group)
        q, scales = quantize_int8_groups(w, group, self.weight_max)
        wscale = paddle.to_tensor(scales)
        wsum = paddle.to_tensor(group_sums(q, group))  # the zero points' correction, once
        if self.path == "onednn":  # one buffer: the packed weights, then wscale and wsum
            weight = ops.w8a8_pack(paddle.to_tensor(q), wscale, wsum, group)
        else:
            weight = paddle.to_tensor(np.ascontiguousarray(q.T))
        layer.register_buffer("qweight", weight, persistable=True)
        layer.register_buffer("weight_scale", wscale, persistable=True)
        layer.register_buffer("weight_sum", wsum, persistable=True)
        object.__setattr__(layer, "_w8a8_q", q)  # [K, N] int8, for dense_weight
        object.__setattr__(layer, "_w8a8_args", (weight, wscale, wsum, layer.bias, group))
        layer.weight = None
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        weight, wscale, wsum, bias, group = layer._w8a8_args
        if self.path == "onednn":
            return ops.w8a8_linear(x, weight, bias, layer.output_size, group)
        return ops.w8a8_linear_portable(x, weight, wscale, wsum, bias, group)

    def kernel_weight(self, layer: LinearBase) -> KernelWeight | None:
        """oneDNN's buffer, for the fused decoder layers (dtype "w8a8"); the portable path runs op by op."""
        weight, _, _, bias, group = layer._w8a8_args
        return KernelWeight(weight, bias, "w8a8", [group]) if self.path == "onednn" else None

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        """The dequantized ``[in, out]`` weight (the activations' rounding is not in it)."""
        q, group = layer._w8a8_q, layer._w8a8_args[4]
        scales = layer._w8a8_args[1].numpy()[np.arange(q.shape[0]) // group]
        return paddle.to_tensor(q.astype(np.float32) * scales)


@register_quantization_config("w8a8")
class W8A8Config(QuantizationConfig):
    """``--quantization w8a8``: int8 weights quantized at load, dynamic per-token u8 activations, both per group of K.

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
