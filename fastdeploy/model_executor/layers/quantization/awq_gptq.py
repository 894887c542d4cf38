"""``awq`` and ``gptq`` (vLLM's names): pre-quantized 4-bit checkpoints on the int4 kernels of ``wint4``.

A checkpoint's ``config.json`` ``quantization_config`` (``quant_method`` "awq" / "gptq") selects
these when ``--quantization`` is not given, as vLLM does. Each projection arrives as the
quantizer stores it (int32 words of eight 4-bit values, fp16 scales, ``out`` = output features):

- AutoAWQ (GEMM): ``qweight [in, out/8]`` and ``qzeros [in/group, out/8]`` packed along the
  output features in the interleaved order ``0 2 4 6 1 3 5 7`` (nibble ``i`` of a word holds
  column ``ORDER[i]`` of its 8); ``scales [in/group, out]``; ``w = scales * (q - zero)``.
- AutoGPTQ: ``qweight [in/8, out]`` packed along the input features in order (nibble ``j`` is
  input row ``8 i + j``); ``qzeros [groups, out/8]`` packed in order along the output features,
  holding ``zero - 1`` (the original GPTQ format, ``checkpoint_format`` "gptq");
  ``scales [groups, out]``; ``g_idx [in]`` the group of each input row. With ``desc_act``
  (rows in activation order) the rows are sorted by group once at load and the activations
  gathered into that order on every call.

Only 4-bit checkpoints have a kernel: other ``bits`` are refused by name.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.layers.linear import LinearBase
from fastdeploy.model_executor.layers.quantization import quantization_config_for, register_quantization_config
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from fastdeploy.model_executor.layers.quantization.int_kernels import Int4Weight
from fastdeploy.model_executor.layers.quantization.weight_only import (
    IntLinearMethod,
    int_kernel_path,
    is_quantized_layer,
    is_skipped_module,
    refuse_gguf,
)
from fastdeploy.model_executor.utils import new_parameter

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(words: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """int32 words of eight 4-bit values -> uint8 values, 8x longer along ``axis``; nibble ``i`` -> slot ``order[i]``."""
    w = np.ascontiguousarray(words).view(np.uint32)
    nibbles = np.stack([(w >> (4 * i)) & 15 for i in range(8)], axis=-1).astype(np.uint8)
    slots = np.empty_like(nibbles)
    slots[..., list(order)] = nibbles
    moved = np.moveaxis(slots, -1, axis + 1) if axis != w.ndim - 1 else slots
    shape = list(w.shape)
    shape[axis] *= 8
    return moved.reshape(shape)


def pack_int32(values: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """The inverse of :func:`unpack_int32` (tests build checkpoints with it)."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for i in range(8):
        words |= v[..., order[i]] << np.uint32(4 * i)
    return np.moveaxis(words, -1, axis).view(np.int32)


class CheckpointInt4Method(IntLinearMethod):
    """A projection loaded from a 4-bit checkpoint's tensors (``qweight``, ``qzeros``, ``scales``[, ``g_idx``]).

    Args:
        fmt: "awq" or "gptq".
        group: the checkpoint's ``group_size`` (-1: per channel, one group of all input rows).
        path: the platform's integer-kernel path.
        zero_offset: added to the stored zeros (GPTQ's original format stores ``zero - 1``).
    """

    def __init__(self, fmt: str, group: int, path: str, zero_offset: int = 0) -> None:
        super().__init__(4, group, path)
        self.fmt, self.zero_offset = fmt, zero_offset
        self.names = ("qweight", "qzeros", "scales") + (("g_idx",) if fmt == "gptq" else ())

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        # Placeholders the model's loader finds by name; the checkpoint's arrays are kept per shard.
        for name in self.names:
            setattr(layer, name, new_parameter([0], "float32"))
        layer.weight = None
        layer.bias = new_parameter([output_size], dtype) if bias else None
        object.__setattr__(layer, "_ckpt", {})

    def weight_loader(self, layer: LinearBase, param: paddle.Tensor, loaded: Any, shard_id: object = None) -> bool:
        name = next((n for n in self.names if getattr(layer, n, None) is param), None)
        if name is None:
            return False
        start = 0 if shard_id is None else layer.shard_offsets[shard_id][0]
        layer._ckpt.setdefault(name, {})[start] = np.asarray(loaded)
        return True

    def _tensor(self, layer: LinearBase, name: str, axis: int) -> np.ndarray:
        shards = layer._ckpt.get(name)
        if not shards:
            raise ValueError(f"{type(layer).__name__}: the {self.fmt} checkpoint has no {name}.")
        parts = [shards[s] for s in sorted(shards)]
        if axis < 0:  # one per input row, the same for every shard (they share the input)
            if any(not np.array_equal(p, parts[0]) for p in parts[1:]):
                raise ValueError(f"{type(layer).__name__}: the shards' {name} differ; a fused layer needs one.")
            return parts[0]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)

    def quantize(self, layer: LinearBase) -> Int4Weight:
        k, n = layer.input_size, layer.output_size
        group = k if self.group == -1 else self.group
        scales = self._tensor(layer, "scales", 1).astype(np.float32)
        order = AWQ_ORDER if self.fmt == "awq" else tuple(range(8))
        zeros = unpack_int32(self._tensor(layer, "qzeros", 1), 1, order).astype(np.float32) + self.zero_offset
        if self.fmt == "awq":
            q = unpack_int32(self._tensor(layer, "qweight", 1), 1, AWQ_ORDER)
            perm = None
        else:
            q = unpack_int32(self._tensor(layer, "qweight", 1), 0)
            g_idx = self._tensor(layer, "g_idx", -1).astype(np.int64)
            perm = None if np.array_equal(g_idx, np.arange(k) // group) else np.argsort(g_idx, kind="stable")
            if perm is not None:
                counts = np.bincount(g_idx, minlength=scales.shape[0])
                if not np.all(counts[:-1] == group):
                    raise ValueError(f"{type(layer).__name__}: g_idx groups are not {group} rows each.")
                q = q[perm]
        if q.shape != (k, n) or scales.shape != zeros.shape or scales.shape[1] != n:
            raise ValueError(f"{type(layer).__name__}: {self.fmt} tensors {q.shape}, scales {scales.shape}, zeros "
                             f"{zeros.shape} do not fit [in, out] = [{k}, {n}] with group {group}.")
        object.__setattr__(layer, "_int_perm", None if perm is None else paddle.to_tensor(perm))
        for name in self.names:  # the placeholders give way to the packed buffers
            layer._parameters.pop(name, None)
        object.__setattr__(layer, "_ckpt", {})
        return Int4Weight(q, scales, zeros, group)

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        perm = layer._int_perm
        return super().apply(layer, x if perm is None else paddle.index_select(x, perm, axis=-1))


class _CheckpointInt4Config(QuantizationConfig):
    """A 4-bit checkpoint format: its ``quantization_config`` (or quantizer's own json file beside the weights).

    Args:
        bits: must be 4.
        group: ``group_size``; -1: one group of all input rows (per channel).
        zero_offset: added to the stored zeros (1 for GPTQ's original format, which stores ``zero - 1``).
        skip: ``modules_to_not_convert``: layers the checkpoint keeps unquantized (any part of a layer's name).
    """

    fmt = ""

    def __init__(self, bits: int = 4, group: int = 128, zero_offset: int = 0, skip: list[str] | None = None) -> None:
        if bits != 4:
            raise ValueError(f"quantization={self.fmt!r} with bits={bits} has no CPU kernel; supported: bits=4.")
        if group <= 0 and group != -1:
            raise ValueError(f"quantization={self.fmt!r}: group_size={group} is not supported; supported: a positive "
                             "group_size, or -1 (per channel).")
        self.group, self.zero_offset, self.skip = group, zero_offset, list(skip or [])
        self.path = int_kernel_path(self.fmt)

    def __repr__(self) -> str:
        skip = f", modules_to_not_convert={self.skip}" if self.skip else ""
        return f"{type(self).__name__}(bits=4, group_size={self.group}{skip}, kernel={self.path})"

    @classmethod
    def get_name(cls) -> str:
        return cls.fmt

    @classmethod
    def check_tensor_parallel(cls, tensor_parallel_size: int) -> None:
        if tensor_parallel_size > 1:
            raise ValueError(f"quantization={cls.fmt!r} under tensor parallelism is not supported (the packed "
                             "qweight / qzeros / g_idx are not split per rank); supported: tensor_parallel_size=1.")

    @classmethod
    def _refuse(cls, field: str, value: Any, supported: str) -> ValueError:
        return ValueError(f"quantization={cls.fmt!r}: {field}={value!r} in the checkpoint's quantization config is "
                          f"not supported on CPU; supported: {supported}.")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _CheckpointInt4Config:
        # Fields that change the layout or what is quantized: honoured, or refused by name.
        if config.get("lm_head"):
            raise cls._refuse("lm_head", config["lm_head"], "lm_head=false (the LM head unquantized)")
        if config.get("dynamic"):
            raise cls._refuse("dynamic", config["dynamic"], "no per-module overrides")
        if config.get("modules_in_block_to_quantize"):
            raise cls._refuse("modules_in_block_to_quantize", config["modules_in_block_to_quantize"],
                              "every projection quantized (modules_to_not_convert for exceptions)")
        bits = int(config.get("bits", config.get("w_bit", 4)))
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        return cls(bits, group, cls._zero_offset(config), config.get("modules_to_not_convert"))

    @classmethod
    def _zero_offset(cls, config: dict[str, Any]) -> int:
        """What the format adds to its stored zeros (after refusing the layouts it does not load)."""
        return 0

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        refuse_gguf(cls.fmt, model_config)
        config = quantization_config_for(cls.fmt, model_config)
        if not config:
            files = " or ".join(cls.get_config_filenames())
            raise ValueError(f"quantization={cls.fmt!r} loads a pre-quantized checkpoint; {model_config.model!r} "
                             f"has no quantization_config in config.json and no {files} (use wint4 to quantize a "
                             "bf16/fp32 checkpoint at load).")
        method = str(config.get("quant_method", cls.fmt)).lower()
        if method != cls.fmt:  # e.g. -q awq on a folder whose quantize_config.json is AutoGPTQ's
            raise ValueError(f"quantization={cls.fmt!r}: {model_config.model!r}'s quantization settings name the "
                             f"method {method!r}; use --quantization {method}.")
        cls.from_config(config)  # its refusals at start-up

    def get_quant_method(self, layer: nn.Layer, prefix: str) -> QuantizeMethodBase | None:
        if not is_quantized_layer(layer) or is_skipped_module(prefix, self.skip, self.fmt, "modules_to_not_convert",
                                                               substring=True):
            return None
        return CheckpointInt4Method(self.fmt, self.group, self.path, self.zero_offset)


@register_quantization_config("awq")
class AWQConfig(_CheckpointInt4Config):
    """``--quantization awq``: AutoAWQ 4-bit (GEMM layout) checkpoints."""

    fmt = "awq"

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return ["quant_config.json", "quantize_config.json"]

    @classmethod
    def _zero_offset(cls, config: dict[str, Any]) -> int:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise cls._refuse("version", config["version"], "'gemm' (the qweight [in, out/8] layout)")
        if not config.get("zero_point", True):
            raise cls._refuse("zero_point", config["zero_point"], "zero_point=true (checkpoints with qzeros)")
        return 0


@register_quantization_config("gptq")
class GPTQConfig(_CheckpointInt4Config):
    """``--quantization gptq``: AutoGPTQ 4-bit checkpoints (``g_idx`` / ``desc_act`` included)."""

    fmt = "gptq"

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def _zero_offset(cls, config: dict[str, Any]) -> int:
        # AutoGPTQ's original format stores zero - 1; gptq_v2 (GPTQModel) stores the zeros themselves.
        fmt = str(config.get("checkpoint_format") or "gptq").lower()
        if config.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
            raise cls._refuse("checkpoint_format", "marlin" if config.get("is_marlin_format") else fmt,
                              "'gptq' and 'gptq_v2'")
        return 1 if fmt == "gptq" else 0
