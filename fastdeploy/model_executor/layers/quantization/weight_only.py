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

The decoder's projections and the MoE experts (:class:`IntFusedMoEMethod`, ``fd_int_fused_moe``:
int_gemm.cc per expert) are quantized; the LM head, the embedding and the MoE routers stay as the
checkpoint has them (as FastDeploy and vLLM's weight-only formats do).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase, UnquantizedFusedMoEMethod
from fastdeploy.model_executor.layers.linear import KernelWeight, LinearBase, LinearMethodBase, UnquantizedLinearMethod
from fastdeploy.model_executor.layers.quantization import register_quantization_config
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from fastdeploy.model_executor.layers.quantization.int_kernels import (
    KERNEL_PATHS,
    ONEDNN_MIN_GROUP,
    ONEDNN_PATH,
    Int4Weight,
    Int8Weight,
    linear_buffer,
    onednn_group,
    onednn_operands,
    pack_int4,
    pack_int8,
    path_for_dtype,
    quantize_int4,
    quantize_int8,
    split_linear_buffer,
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


# The checkpoint's projections behind each fused layer (a checkpoint's list of unquantized modules names those).
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def is_skipped_module(prefix: str, skip: list[str], method: str, field: str, substring: bool = False) -> bool:
    """Whether the layer ``prefix`` is one a checkpoint's ``field`` leaves unquantized: a name equal to or a parent
    of it (fp8's ``ignored_layers``), or, with ``substring``, any part of it (AWQ's ``modules_to_not_convert``,
    as vLLM matches it). A fused layer is all of its projections or none of them (a ValueError otherwise)."""
    owner, _, leaf = prefix.rpartition(".")
    names = [f"{owner}.{s}" if owner else s for s in FUSED_SHARDS.get(leaf, (leaf,))]
    skipped = {any((m in n) if substring else (n == m or n.startswith(m + ".")) for m in skip) for n in names}
    if len(skipped) > 1:
        how = " (its entries match any part of a layer's name, as in vLLM)" if substring else ""
        raise ValueError(f"quantization={method!r}: {field}{how} names some of the projections fused in {prefix} "
                         f"({', '.join(names)}) but not all; they must be quantized alike.")
    return skipped.pop()


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

    def set_packed(self, layer: LinearBase, weight: Int8Weight | Int4Weight, dtype: str) -> None:
        """Pack ``weight`` for the kernel of a model computing in ``dtype``, keep it as the layer's buffers and
        the op's arguments; drop the fp32 weight."""
        k = weight.q.shape[0]
        # A checkpoint's per-channel group (-1) is known per layer: the weight carries its own.
        weight_group = weight.group if isinstance(weight, Int4Weight) else self.group
        group = onednn_group(k, weight) if self.path == ONEDNN_PATH else None
        if group is not None:
            q, scales = onednn_operands(weight, group)
            tensors = [ops.weight_only_pack(paddle.to_tensor(q), group), paddle.to_tensor(scales)]
            args: tuple[Any, ...] = ("onednn", tensors[0], tensors[1], layer.bias, layer.output_size, group)
        else:
            if self.path == ONEDNN_PATH:  # a group too fine for oneDNN: AVX-512's int_gemm (onednn implies it)
                logger.info("%s [%d, %d] int%d group %d: int_gemm avx512 (oneDNN needs whole groups of >= %d rows)",
                            type(layer).__name__, k, layer.output_size, self.bits, weight_group, ONEDNN_MIN_GROUP)
            packed = pack_int8(*weight) if isinstance(weight, Int8Weight) else pack_int4(weight)
            tensors = [paddle.to_tensor(linear_buffer(packed))]
            group = weight_group if self.bits == 4 else None
            isa = KERNEL_PATHS["avx512" if self.path == ONEDNN_PATH else path_for_dtype(self.path, dtype, k, group)]
            args = ("int_gemm", tensors[0], layer.bias, layer.output_size, self.bits, weight_group, isa)
        for name, t in zip(("qweight", "scales"), tensors, strict=False):
            layer.register_buffer(name, t, persistable=True)
        object.__setattr__(layer, "_int_args", args)
        # The integers themselves, for dense_weight (oneDNN's blocked layout is not read back).
        object.__setattr__(layer, "_int_weight", weight if group is not None else None)
        layer.weight = None

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Quantize and pack once; True: the layer computes (fp32 out; bf16 activations on the bf16 path of a
        bf16 model) whatever ``dtype`` is."""
        if getattr(layer, "_int_args", None) is None:
            self.set_packed(layer, self.quantize(layer), dtype)
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        kind, *args = layer._int_args
        return ops.weight_only_linear(x, *args) if kind == "onednn" else ops.int_linear(x, *args)

    def kernel_weight(self, layer: LinearBase) -> KernelWeight | None:
        kind, *args = layer._int_args
        if kind != "int_gemm" or getattr(layer, "_int_perm", None) is not None:  # GPTQ's act-order permutes x first
            return None
        packed, bias, _, bits, group, isa = args
        return KernelWeight(packed, bias, "int", [bits, group, isa])

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        if layer._int_weight is not None:
            return paddle.to_tensor(layer._int_weight.dequantize())
        _, packed, _, n, bits, group, _ = layer._int_args
        k = layer.input_size
        parts = split_linear_buffer(packed.numpy(), bits, k, n, group)
        return paddle.to_tensor(unpack_int8(*parts, k, n) if bits == 8 else unpack_int4(*parts, k, n, group))


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)


def int_gemm_isa(path: str, where: str) -> int:
    """int_gemm.cc's isa for the platform's integer path; ``onednn`` (linear layers only) gives its AVX-512 path."""
    if path == ONEDNN_PATH:
        _log_once(f"{where}: int_gemm avx512 (oneDNN's weight decompression serves linear layers only)")
        path = "avx512"
    return KERNEL_PATHS[path]


class IntFusedMoEMethod(FusedMoEMethodBase):
    """MoE experts as wint8 (per channel) / wint4 (per group) integers, run by ``fd_int_fused_moe``.

    Every expert's ``[H, 2I]`` gate|up and ``[I, H]`` down weights are quantized at load exactly
    as :class:`IntLinearMethod` quantizes a linear layer, and multiplied by the same int_gemm.cc
    kernel (the platform's path), inside moe.cc's one grouping code path.

    Args:
        bits: 8 or 4.
        group: rows of K per 4-bit scale.
        path: the platform's integer-kernel path (``onednn`` runs int_gemm's AVX-512 path here).
    """

    shared_expert_dtypes = ops.SHARED_EXPERT_DTYPES

    def __init__(self, bits: int, group: int, path: str) -> None:
        self.bits, self.group, self.path = bits, group, path

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, intermediate_size: int,
                       dtype: str) -> None:
        # Loaded in fp32 through the layer's own loader, quantized once loaded.
        UnquantizedFusedMoEMethod.create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype)  # type: ignore[arg-type]

    def _quantize(self, weights: paddle.Tensor) -> list[paddle.Tensor]:
        """``[E, out, in]`` -> ``[qweight [E, bytes], scales [E, n](, mins [E, n])]``: each expert's ``[in, out]`` packed."""
        per_expert = []
        for e in range(weights.shape[0]):
            w = weights[e].astype("float32").numpy().T
            weight = quantize_int8(w) if self.bits == 8 else quantize_int4(w, self.group, INT4_SHRINKS)
            per_expert.append(pack_int8(*weight) if isinstance(weight, Int8Weight) else pack_int4(weight))
        return [paddle.to_tensor(np.stack(parts)) for parts in zip(*per_expert, strict=True)]

    def process_weights_after_loading(self, layer: FusedMoE, dtype: str) -> bool:
        """Quantize and pack every expert once; True: the experts compute (in fp32) whatever ``dtype`` is."""
        if getattr(layer, "_int_moe_args", None) is not None:
            return True
        w13, w2 = self._quantize(layer.w13_weight), self._quantize(layer.w2_weight)
        for prefix, tensors in (("w13", w13), ("w2", w2)):
            for name, t in zip(("qweight", "scales", "mins"), tensors, strict=False):
                layer.register_buffer(f"{prefix}_{name}", t, persistable=True)
        mins13, mins2 = (w13[2], w2[2]) if self.bits == 4 else (None, None)
        group = self.group if self.bits == 4 else None
        path = self.path  # one path for both GEMMs: K = hidden (gate|up) and K = intermediate (down)
        for k in (layer.hidden_size, layer.intermediate_size):
            path = path_for_dtype(path, dtype, k, group)
        isa = int_gemm_isa(path, f"wint{self.bits} MoE experts")
        object.__setattr__(layer, "_int_moe_args", (w13[0], w13[1], mins13, w2[0], w2[1], mins2,
                                                    layer.intermediate_size, self.bits, self.group, isa))
        layer.w13_weight = None
        layer.w2_weight = None
        return True

    def apply(self, layer: FusedMoE, x: paddle.Tensor, topk_weights: paddle.Tensor, topk_ids: paddle.Tensor,
              shared: ops.SharedExperts | None = None, shared_weights: paddle.Tensor | None = None) -> paddle.Tensor:
        return ops.int_fused_moe(x, topk_ids, topk_weights, *layer._int_moe_args, shared, shared_weights)

    def dense_weights(self, layer: FusedMoE) -> tuple[paddle.Tensor, paddle.Tensor]:
        q13, s13, m13, q2, s2, m2, inter, bits, group, _ = layer._int_moe_args
        hidden = layer.hidden_size

        def unpack(q: paddle.Tensor, s: paddle.Tensor, m: paddle.Tensor | None, k: int, n: int) -> paddle.Tensor:
            experts = [unpack_int8(q[e].numpy(), s[e].numpy(), k, n) if bits == 8 else
                       unpack_int4(q[e].numpy(), s[e].numpy(), m[e].numpy(), k, n, group) for e in range(q.shape[0])]
            return paddle.to_tensor(np.ascontiguousarray(np.stack(experts).transpose(0, 2, 1)))

        return unpack(q13, s13, m13, hidden, 2 * inter), unpack(q2, s2, m2, inter, hidden)


class _WeightOnlyConfig(QuantizationConfig):
    """A format quantized at load: the decoder's projections get an :class:`IntLinearMethod`, MoE experts an
    :class:`IntFusedMoEMethod`."""

    bits: int = 8
    supports_moe = True

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
        if isinstance(layer, FusedMoE):
            return IntFusedMoEMethod(self.bits, self.group, self.path)
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


__all__ = ["Int4Weight", "IntFusedMoEMethod", "IntLinearMethod", "WInt4Config", "WInt8Config", "int_kernel_path", "is_quantized_layer", "refuse_gguf"]
