"""``fp8`` (vLLM's ``Fp8Config``): weights in e4m3 (``float8_e4m3fn``), one byte each, widened in the kernel.

Two ways in, as in vLLM:

- a checkpoint whose ``config.json`` says ``quantization_config: {"quant_method": "fp8", ...}``
  (selected without ``-q``): each projection's ``weight`` is safetensors ``F8_E4M3`` ``[out, in]``
  with either a per-tensor ``weight_scale`` (Fp8Config's default; a per-channel ``[out]`` /
  ``[out, 1]`` one is taken too) or, with ``weight_block_size: [bn, bk]`` (DeepSeek-V3's
  ``[128, 128]``), a block-wise ``weight_scale_inv [ceil(out/bn), ceil(in/bk)]``; ``w = q * scale``.
- ``-q fp8`` on a bf16/fp32 checkpoint: quantized at load, per output channel (vLLM takes one
  scale per tensor; one per channel loses less).

Weights-only (W8A16): these CPUs have no fp8 arithmetic, so activations stay in the model's
bf16/fp32, and a static checkpoint's ``input_scale`` is read and not used. The kernel
(``csrc/cpu/fp8_gemm.cc``) widens the codes in registers and applies the per-channel or block
scales per group of K; the path is the platform's choice (``OpBackend.fp8``, ``FD_CPU_FP8_KERNEL``),
and its bf16 dot products (``avx512-bf16``) serve bf16 models only: an fp32 model gets fp32 FMAs.

The decoder's projections are quantized; the LM head, the embedding and the checkpoint's
``ignored_layers`` stay as the checkpoint has them. Refused by name: e5m2 weights, other
activation schemes, an odd block size along K, fp8 checkpoints under tensor parallelism, and
compressed-tensors checkpoints (by the platform: no loader for them).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.distributed.parallel_state import get_tensor_model_parallel_world_size
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.linear import KernelWeight, LinearBase, LinearMethodBase, UnquantizedLinearMethod
from fastdeploy.model_executor.layers.quantization import register_quantization_config
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from fastdeploy.model_executor.layers.quantization.int_kernels import path_for_dtype
from fastdeploy.model_executor.layers.quantization.weight_only import is_quantized_layer, is_skipped_module, refuse_gguf
from fastdeploy.model_executor.utils import new_parameter

logger = init_logger(__name__)

NAME = "fp8"
E4M3_MAX = 448.0  # the largest finite e4m3 value (code 0x7E)
PANEL = 16
# The kernel path names (OpBackend.fp8) -> the op's isa argument.
KERNEL_PATHS = {"scalar": 0, "avx2": 1, "avx512": 2, "avx512-bf16": 3, "amx-bf16": 4}


@cache
def e4m3_values() -> np.ndarray:
    """The fp32 value of each of the 256 e4m3 codes: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 holds the subnormals ``m * 2^-9``; 0x7F / 0xFF are NaN (no infinity)."""
    codes = np.arange(256)
    e, m = (codes >> 3) & 15, codes & 7
    mag = np.where(e > 0, np.ldexp(1 + m / 8, e - 7), np.ldexp(m / 8, -6))
    mag[(codes & 0x7F) == 0x7F] = np.nan
    return np.where(codes & 0x80, -mag, mag).astype(np.float32)


def float_to_e4m3(x: np.ndarray) -> np.ndarray:
    """The nearest e4m3 codes of ``x`` (uint8; ties to the even code, as torch's cast), saturated at ±448."""
    x = np.asarray(x, dtype=np.float32)
    mags = e4m3_values()[:127]  # codes 0..126: 0 .. 448, increasing
    a = np.minimum(np.abs(x), np.float32(E4M3_MAX))
    hi = np.minimum(np.searchsorted(mags, a), 126)
    lo = np.maximum(hi - 1, 0)
    d_hi, d_lo = mags[hi] - a, a - mags[lo]
    code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo).astype(np.uint8)
    code |= np.signbit(x).astype(np.uint8) << 7
    code[np.isnan(x)] = 0x7F
    return code


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel e4m3 of ``w [K, N]``: ``(codes uint8 [K, N], scales [N])``, ``w ~ value(codes) * scale``."""
    scales = (np.abs(w).max(axis=0) / np.float32(E4M3_MAX)).astype(np.float32)
    inv = np.divide(np.float32(1), scales, out=np.zeros_like(scales), where=scales != 0)
    return float_to_e4m3(w * inv), scales


def pack_fp8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The kernel's uint8 buffer of e4m3 ``codes [K, N]`` with ``scales [G, N]`` (one row per group of K): the
    codes in 16-column panels, then the fp32 scales per panel (see ``csrc/cpu/pair_gemm_impl.h``)."""
    k, n = codes.shape
    kh, p = -(-k // 2), -(-n // PANEL)
    padded = np.zeros((2 * kh, p * PANEL), dtype=np.uint8)
    padded[:k, :n] = codes
    qweight = padded.reshape(kh, 2, p, PANEL).transpose(2, 0, 3, 1)
    groups = scales.shape[0]
    s = np.zeros((groups, p * PANEL), dtype=np.float32)
    s[:, :n] = scales
    packed_scales = np.ascontiguousarray(s.reshape(groups, p, PANEL).transpose(1, 0, 2))
    return np.concatenate([np.ascontiguousarray(qweight).reshape(-1), packed_scales.reshape(-1).view(np.uint8)])


def unpack_fp8(weight: np.ndarray, k: int, n: int, group: int) -> np.ndarray:
    """The fp32 ``[K, N]`` weight of :func:`pack_fp8`'s buffer (``group`` rows of K per scale)."""
    kh, p = -(-k // 2), -(-n // PANEL)
    qweight, scales = weight[: p * kh * 2 * PANEL], weight[p * kh * 2 * PANEL :].view(np.float32)
    codes = qweight.reshape(p, kh, PANEL, 2).transpose(1, 3, 0, 2).reshape(2 * kh, p * PANEL)[:k, :n]
    groups = scales.size // (p * PANEL)
    s = scales.reshape(p, groups, PANEL).transpose(1, 0, 2).reshape(groups, p * PANEL)[:, :n]
    return (e4m3_values()[codes] * s[np.arange(k) // group]).astype(np.float32)


class Fp8LinearMethod(LinearMethodBase):
    """A linear layer whose weight is e4m3 codes with per-channel or block scales, in the kernel's panels.

    Args:
        config: the model's :class:`Fp8Config` (checkpoint form, block size, activation scheme, kernel path).
    """

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        scale = "weight_scale_inv" if config.weight_block_size else "weight_scale"
        self.names = ("weight", scale) + (("input_scale",) if config.activation_scheme == "static" else ())

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        if not self.config.is_checkpoint_fp8_serialized:
            UnquantizedLinearMethod.create_weights(self, layer, input_size, output_size, bias, dtype)  # type: ignore[arg-type]
            return
        # Placeholders the model's loader finds by name; the checkpoint's arrays are kept per shard.
        for name in self.names:
            setattr(layer, name, new_parameter([0], "float32"))
        layer.bias = new_parameter([output_size], dtype) if bias else None
        object.__setattr__(layer, "_ckpt", {})

    def weight_loader(self, layer: LinearBase, param: paddle.Tensor, loaded: Any, shard_id: object = None) -> bool:
        if not self.config.is_checkpoint_fp8_serialized:
            return False
        name = next((n for n in self.names if getattr(layer, n, None) is param), None)
        if name is None:
            return False
        start = 0 if shard_id is None else layer.shard_offsets[shard_id][0]
        layer._ckpt.setdefault(name, {})[start] = loaded
        return True

    def _shard(self, layer: LinearBase, weight: Any, scale: Any) -> tuple[np.ndarray, np.ndarray]:
        """One checkpoint projection: (codes [n, K], scales [n, G]) from its fp8 weight and scale."""
        what = type(layer).__name__
        fmt = getattr(weight, "fmt", None)
        if fmt != "e4m3":
            kind = f"fp8 {fmt}" if fmt else f"{np.asarray(weight).dtype} (not fp8)"
            raise ValueError(f"quantization='fp8': {what}'s weight is {kind}; supported: e4m3 (float8_e4m3fn) weights.")
        codes = np.asarray(weight.raw)
        rows, k = codes.shape
        s = np.asarray(scale, dtype=np.float32)
        block = self.config.weight_block_size
        if block:
            bn, bk = block
            if s.shape != (-(-rows // bn), -(-k // bk)):
                raise ValueError(f"{what}: weight_scale_inv {s.shape} does not fit the weight [{rows}, {k}] in "
                                 f"blocks of {block}.")
            return codes, np.repeat(s, bn, axis=0)[:rows]
        s = s.reshape(-1)
        if s.size not in (1, rows):
            raise ValueError(f"{what}: weight_scale has {s.size} values; expected 1 (per tensor) or {rows} (per channel).")
        return codes, np.broadcast_to(s, (rows,))[:, None]

    def _checkpoint_weight(self, layer: LinearBase) -> tuple[np.ndarray, np.ndarray]:
        """The layer's (codes [K, N], scales [G, N]) from its shards, in the order of its output columns."""
        shards = {name: layer._ckpt.get(name, {}) for name in self.names}
        weights, scales = shards["weight"], shards[self.names[1]]
        if not weights or sorted(weights) != sorted(scales):
            raise ValueError(f"{type(layer).__name__}: the fp8 checkpoint lacks the weight or its {self.names[1]}.")
        parts = [self._shard(layer, weights[s], scales[s]) for s in sorted(weights)]
        codes = np.concatenate([c for c, _ in parts], axis=0)
        if codes.shape != (layer.output_size, layer.input_size):
            raise ValueError(f"{type(layer).__name__}: fp8 weight {codes.shape} does not fit [out, in] = "
                             f"[{layer.output_size}, {layer.input_size}].")
        for name in self.names:  # the placeholders give way to the packed buffers
            layer._parameters.pop(name, None)
        object.__setattr__(layer, "_ckpt", {})
        return np.ascontiguousarray(codes.T), np.ascontiguousarray(np.concatenate([s for _, s in parts], axis=0).T)

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Pack once (quantizing a bf16/fp32 weight first); True: the layer computes in ``dtype`` whatever it is."""
        if getattr(layer, "_fp8_args", None) is not None:
            return True
        k, n = layer.input_size, layer.output_size
        if self.config.is_checkpoint_fp8_serialized:
            codes, scales = self._checkpoint_weight(layer)
            block = self.config.weight_block_size
            group = block[1] if block and scales.shape[0] > 1 else 2 * -(-k // 2)
        else:
            codes, per_channel = quantize_fp8(layer.weight.numpy())
            scales, group = per_channel[None, :], 2 * -(-k // 2)
        path = path_for_dtype(self.config.kernel_path, dtype, k, group)
        qweight = paddle.to_tensor(pack_fp8(codes, scales))  # the codes, then the scales: one buffer
        layer.register_buffer("qweight", qweight, persistable=True)
        object.__setattr__(layer, "_fp8_args", (qweight, layer.bias, n, group, KERNEL_PATHS[path]))
        object.__setattr__(layer, "_fp8_path", path)
        layer.weight = None
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        return ops.fp8_linear(x, *layer._fp8_args)

    def kernel_weight(self, layer: LinearBase) -> KernelWeight | None:
        """The buffer for the fused decoder layers (dtype "fp8"), with its group and kernel path."""
        qweight, bias, _, group, isa = layer._fp8_args
        return KernelWeight(qweight, bias, "fp8", [group, isa])

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        qweight, _, n, group, _ = layer._fp8_args
        return paddle.to_tensor(unpack_fp8(qweight.numpy(), layer.input_size, n, group))


@register_quantization_config(NAME)
class Fp8Config(QuantizationConfig):
    """``--quantization fp8``: e4m3 weights with per-channel or block scales (W8A16), from an fp8
    checkpoint or quantized at load.

    Args:
        is_checkpoint_fp8_serialized: the checkpoint's weights are fp8 already (vLLM's name).
        activation_scheme: "dynamic" or "static" (the latter's ``input_scale`` is read, not used).
        weight_block_size: ``[bn, bk]`` of block-wise ``weight_scale_inv``; None for per-tensor scales.
        ignored_layers: checkpoint names of layers left unquantized.
    """

    def __init__(self, is_checkpoint_fp8_serialized: bool = False, activation_scheme: str = "dynamic",
                 weight_block_size: list[int] | None = None, ignored_layers: list[str] | None = None) -> None:
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization='fp8': activation_scheme={activation_scheme!r} is not supported; "
                             "supported: dynamic, static.")
        if weight_block_size is not None:
            if len(weight_block_size) != 2 or min(weight_block_size) <= 0 or weight_block_size[1] % 2:
                raise ValueError(f"quantization='fp8': weight_block_size={weight_block_size} is not supported; "
                                 "supported: [bn, bk] with an even bk, e.g. [128, 128].")
            if not is_checkpoint_fp8_serialized:
                raise ValueError("quantization='fp8': weight_block_size needs an fp8 checkpoint "
                                 "(quantizing at load uses per-channel scales).")
        self.is_checkpoint_fp8_serialized = is_checkpoint_fp8_serialized
        self.activation_scheme = activation_scheme
        self.weight_block_size = [int(v) for v in weight_block_size] if weight_block_size else None
        self.ignored_layers = list(ignored_layers or [])
        path = get_op_backend().fp8
        if path not in KERNEL_PATHS:
            raise RuntimeError("quantization='fp8' needs the C++ fp8 kernels (csrc/cpu/fp8_gemm.cc), which are not "
                               "available here (FD_CPU_KERNELS=0, or the kernels did not build: see the warning above).")
        self.kernel_path = path
        static = " The checkpoint's input_scale (static fp8 activations) are not used." if activation_scheme == "static" else ""
        logger.info("fp8 on CPU is weights-only (W8A16): the e4m3 weights are widened in the kernel and the "
                    "activations stay in the model's bf16/fp32 (no fp8 arithmetic here).%s", static)

    def __repr__(self) -> str:
        scales = f"block {self.weight_block_size}" if self.weight_block_size else (
            "per tensor/channel" if self.is_checkpoint_fp8_serialized else "per channel, quantized at load")
        return f"Fp8Config(e4m3 weights, scales {scales}, activation_scheme={self.activation_scheme!r}, kernel_path={self.kernel_path!r})"

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"quantization='fp8' with fmt={fmt!r} is not supported; supported: e4m3 (float8_e4m3fn).")
        return cls(is_checkpoint_fp8_serialized=str(config.get("quant_method", "")).lower() == NAME,
                   activation_scheme=config.get("activation_scheme", "dynamic"),
                   weight_block_size=config.get("weight_block_size"),
                   ignored_layers=config.get("ignored_layers") or config.get("modules_to_not_convert"))

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        refuse_gguf(NAME, model_config)

    def is_skipped(self, prefix: str) -> bool:
        """Whether ``prefix`` is in ``ignored_layers`` (a fused layer: all of its projections, or none)."""
        return is_skipped_module(prefix, self.ignored_layers, NAME, "ignored_layers")

    def get_quant_method(self, layer: nn.Layer, prefix: str) -> QuantizeMethodBase | None:
        if not is_quantized_layer(layer) or self.is_skipped(prefix):
            return None
        if self.is_checkpoint_fp8_serialized and get_tensor_model_parallel_world_size() > 1:
            raise ValueError("quantization='fp8': an fp8 checkpoint under tensor parallelism is not supported (its "
                             "scales are not split per rank); supported: tensor_parallel_size=1, or -q fp8 on a "
                             "bf16/fp32 checkpoint.")
        return Fp8LinearMethod(self)


__all__ = ["E4M3_MAX", "Fp8Config", "Fp8LinearMethod", "e4m3_values", "float_to_e4m3", "pack_fp8", "quantize_fp8",
           "unpack_fp8"]
