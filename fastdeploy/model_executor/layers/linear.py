"""Linear layers with vLLM's names and its layer-method interface. Weights are stored ``[in, out]``.

Each layer gets a :class:`LinearMethodBase` when it is built (vLLM's ``quant_method``):
``create_weights`` registers the parameters the checkpoint is loaded into,
``process_weights_after_loading`` converts them once, ``apply`` is the forward. Without a
quantization config the method is :class:`UnquantizedLinearMethod`: on the kernel backend it
packs each weight once, in bf16 or fp32, into the layout of the linear kernel
(``csrc/cpu/linear.cc``: oneDNN on AMX / AVX512-BF16 CPUs, the 16-column panel kernel of
``csrc/cpu/panel_gemm.cc`` on AVX2 ones; fp32 accumulation either way) and drops the fp32
parameter; on the plain-Paddle backend the forward is ``paddle.matmul``.

Tensor parallelism (``fastdeploy.distributed.parallel_state``): a column-parallel layer holds
its rank's output rows, a row-parallel one its input columns and ends with one all-reduce;
each rank loads only its slice of the checkpoint (``tp_shard.shard_tensor``, GGUF blocks
included), so every linear method shards the same way. At one rank they are the plain layer.
Checkpoint weights arrive in Hugging Face's ``[out, in]`` layout and are transposed once at
load time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.distributed.parallel_state import (
    divide,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    kv_heads_per_rank,
    tensor_model_parallel_all_reduce,
)
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.quantization.base_config import QuantizeMethodBase
from fastdeploy.model_executor.layers.tp_shard import shard_tensor
from fastdeploy.model_executor.utils import load_into, load_into_slice, new_parameter, param_dtype

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
    from fastdeploy.platforms.interface import OpBackend

# Compute dtypes the packed-weight kernel takes.
PACKED_DTYPES = ("float32", "bfloat16")


class KernelWeight(NamedTuple):
    """A linear layer's weight as the fused decoder-layer kernel (``fd_decoder_layers``) takes it."""

    weight: paddle.Tensor  # packed for the linear kernel, GGUF blocks, or a quantized format's one buffer
    bias: paddle.Tensor | None
    dtype: str  # "bfloat16" / "float32" (packed), "gguf", "int", "w8a8" or "fp8"
    # GGUF (type, rows) pairs; "int" (bits, group, path); "w8a8" (group); "fp8" (group, path); empty when packed
    segments: list[int]
    gguf_isa: int = 0  # the GGUF kernel path


class LinearMethodBase(QuantizeMethodBase):
    """How a linear layer holds its weight and multiplies with it (vLLM's ``LinearMethodBase``)."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        """Register ``weight`` (and ``bias``) on ``layer`` in the layout the checkpoint is loaded into."""
        raise NotImplementedError

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        """``x @ W (+ b)`` on the processed weight."""
        raise NotImplementedError

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        """The ``[in, out]`` fp32 weight (for inspection and export, not the forward)."""
        raise NotImplementedError

    def weight_loader(self, layer: LinearBase, param: paddle.Tensor, loaded: Any, shard_id: object = None) -> bool:
        """Load a checkpoint tensor the method keeps in its own form; False leaves it to the layer's loader."""
        return False

    def kernel_weight(self, layer: LinearBase) -> KernelWeight | None:
        """The processed weight for the fused decoder-layer kernel; None where that kernel cannot take it."""
        return None

    def tie_weights(self, layer: LinearBase, embedding: nn.Layer) -> None:
        """Make ``layer`` (an LM head) multiply with ``embedding``'s table (tied word embeddings)."""
        raise NotImplementedError(f"{type(self).__name__} cannot tie an LM head to an embedding.")


class UnquantizedLinearMethod(LinearMethodBase):
    """fp32 checkpoint weights, packed once for the linear kernel in fp32 or bf16, or kept for ``paddle.matmul``.

    Args:
        backend: the platform's kernel choice; packing happens only where its linear path is a kernel.
    """

    def __init__(self, backend: OpBackend | None = None) -> None:
        self.use_kernel = (backend or get_op_backend()).uses_kernel("linear")

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool, dtype: str) -> None:
        layer.weight = new_parameter([input_size, output_size], dtype)
        layer.bias = new_parameter([output_size], dtype) if bias else None

    def process_weights_after_loading(self, layer: LinearBase, dtype: str) -> bool:
        """Pack the loaded weight once for ``dtype`` ("float32" or "bfloat16"); False where it stays unpacked."""
        if layer._packed_args is not None:
            return True
        weight = layer.weight
        if not self.use_kernel or dtype not in PACKED_DTYPES or weight is None or param_dtype(weight) != "float32":
            return False
        packed = ops.linear_pack(weight, dtype)
        layer.register_buffer("packed_weight", packed, persistable=True)
        object.__setattr__(layer, "_packed_args", (packed, layer.bias, int(weight.shape[1]), dtype))
        object.__setattr__(layer, "_packed_in", int(weight.shape[0]))
        # The packed copy replaces the fp32 weight: keeping both would double the weights' memory.
        layer.weight = None
        return True

    def apply(self, layer: LinearBase, x: paddle.Tensor) -> paddle.Tensor:
        args = layer._packed_args
        if args is not None:
            return ops.linear(x, *args)
        # Not packed (plain-Paddle backend, or before loading finished): a separate add, because
        # F.linear's fused path is slower than matmul + add on CPU.
        out = paddle.matmul(x, layer.weight)
        return out if layer.bias is None else out + layer.bias

    def kernel_weight(self, layer: LinearBase) -> KernelWeight | None:
        if layer._packed_args is None:
            return None
        packed, bias, _, dtype = layer._packed_args
        return KernelWeight(packed, bias, dtype, [])

    def tie_weights(self, layer: LinearBase, embedding: nn.Layer) -> None:
        # A transposed copy: on CPU matmul(x, W) is ~1.7x faster than matmul(x, E, transpose_y=True) at batch 1.
        layer.weight.set_value(paddle.transpose(embedding.weight, [1, 0]))

    def dense_weight(self, layer: LinearBase) -> paddle.Tensor:
        if layer._packed_args is None:
            return layer.weight
        packed, _, n, dtype = layer._packed_args
        return ops.linear_unpack(packed, layer._packed_in, n, dtype)


class LinearBase(nn.Layer):
    """``y = x @ W (+ b)`` with ``W`` of shape ``[input_size, output_size]``, computed by its linear method.

    Args:
        quant_config: the model's quantization config; None (or a config that skips this
            layer) gives :class:`UnquantizedLinearMethod`.
        prefix: the layer's checkpoint name, for the quantization config.
    """

    # (packed, bias, out_features, dtype) once packed: the kernel's arguments in one plain attribute,
    # because Paddle resolves parameters and buffers through Layer.__getattr__ (~1 us per access).
    _packed_args: tuple | None = None
    _packed_in: int = 0  # K of the packed [K, N] weight

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        object.__setattr__(self, "quant_method", method or UnquantizedLinearMethod())
        self.quant_method.create_weights(self, input_size, output_size, bias, dtype)

    @property
    def is_packed(self) -> bool:
        return self._packed_args is not None

    def process_weights_after_loading(self, dtype: str) -> bool:
        """Convert the loaded weights once for the compute ``dtype``; False where they stay as loaded."""
        return self.quant_method.process_weights_after_loading(self, dtype)

    def dense_weight(self) -> paddle.Tensor:
        """The ``[in, out]`` fp32 weight, unpacked again when packed (for inspection and export, not the forward)."""
        return self.quant_method.dense_weight(self)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.quant_method.apply(self, x)

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load a Hugging Face tensor (weight ``[out, in]`` or bias ``[out]``) into ``param``."""
        if self.quant_method.weight_loader(self, param, loaded, shard_id):
            return
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id={shard_id!r}.")
        load_into(param, loaded.T if param is self.weight else loaded, type(self).__name__)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


def process_linear_weights(model: nn.Layer, dtype: str) -> str:
    """Run every linear layer's ``process_weights_after_loading``; returns the dtype the matmuls compute in.

    Raises:
        RuntimeError: ``dtype`` is bfloat16 but some linear layer cannot compute in it (no kernel).
    """
    packed = [m.process_weights_after_loading(dtype) for m in model.sublayers() if isinstance(m, LinearBase)]
    if dtype == "bfloat16" and not all(packed):
        raise RuntimeError("bfloat16 needs the C++ linear kernel (csrc/cpu), which is not available.")
    return dtype if packed and all(packed) else "float32"


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""


class ColumnParallelLinear(LinearBase):
    """Output dimension split across tensor-parallel ranks: rank r holds output rows ``[r * N/tp, (r+1) * N/tp)``.

    Each rank computes its own slice of the output; nothing is exchanged (the next layer is a
    :class:`RowParallelLinear`, or the slices are gathered). ``output_size`` is the whole layer's;
    ``partitioned`` says it is already this rank's share (the fused layers size their shards).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "", *, partitioned: bool = False) -> None:
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        local = output_size if partitioned else divide(output_size, tp_size, f"{prefix or 'the layer'}'s output size")
        super().__init__(input_size, local, bias, dtype, quant_config, prefix)
        self.tp_size, self.tp_rank = tp_size, tp_rank

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load this rank's rows of the HF tensor (weight ``[out, in]`` or bias ``[out]``)."""
        if self.tp_size > 1 and shard_id is None:
            loaded = shard_tensor(loaded, 0, self.tp_rank * self.output_size, self.output_size, type(self).__name__)
        super().weight_loader(param, loaded, shard_id)


class RowParallelLinear(LinearBase):
    """Input dimension split across tensor-parallel ranks; the partial products are summed by one all-reduce.

    The input is the previous column-parallel layer's slice, so nothing is exchanged before the
    matmul. The bias is kept on rank 0 only (zeros elsewhere), so the sum adds it once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        local = divide(input_size, tp_size, f"{prefix or 'the layer'}'s input size")
        super().__init__(local, output_size, bias, dtype, quant_config, prefix)
        self.tp_size, self.tp_rank = tp_size, tp_rank

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load this rank's input columns of the HF weight ``[out, in]``; the bias whole on rank 0."""
        if self.tp_size > 1:
            if param is self.bias:
                loaded = loaded if self.tp_rank == 0 else np.zeros_like(loaded)
            else:
                loaded = shard_tensor(loaded, 1, self.tp_rank * self.input_size, self.input_size,
                                      type(self).__name__)
        super().weight_loader(param, loaded, shard_id)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.quant_method.apply(self, x)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class _FusedColumnLinear(ColumnParallelLinear):
    """Several projections of the same input concatenated along the output dimension.

    ``shard_sizes`` are this rank's shares; ``shard_starts`` where each share begins in the
    checkpoint's whole projection (rank * share, or a replicated KV head's start).
    """

    def __init__(self, input_size: int, shard_sizes: dict[object, int], bias: bool, dtype: str,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 shard_starts: dict[object, int] | None = None) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias, dtype, quant_config, prefix, partitioned=True)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        self.shard_starts = shard_starts or {shard: self.tp_rank * size for shard, size in shard_sizes.items()}

    @property
    def shard_ids(self) -> tuple[object, ...]:
        """Shard ids that together fill the fused weight."""
        return tuple(self.shard_offsets)

    def checkpoint_shard_sizes(self) -> dict[object, int]:
        """Each projection's rows in the checkpoint (all ranks together)."""
        return {shard: size * self.tp_size for shard, (_, size) in self.shard_offsets.items()}

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load one projection's HF tensor into its columns of the fused weight (or bias)."""
        if shard_id is None:  # an already fused checkpoint tensor
            if self.tp_size == 1:
                LinearBase.weight_loader(self, param, loaded)
                return
            # Each rank's share of every projection: split the fused rows back into projections.
            start = 0
            for shard, rows in self.checkpoint_shard_sizes().items():
                self.weight_loader(param, shard_tensor(loaded, 0, start, rows, type(self).__name__), shard)
                start += rows
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"Unknown shard {shard_id!r} for {type(self).__name__}; known: {list(self.shard_offsets)}."
            )
        start, size = self.shard_offsets[shard_id]
        name = f"{type(self).__name__}[{shard_id}]"
        if self.tp_size > 1:
            loaded = shard_tensor(loaded, 0, self.shard_starts[shard_id], size, name)
        if self.quant_method.weight_loader(self, param, loaded, shard_id):
            return
        if param is self.weight:
            load_into_slice(param, loaded.T, start, size, axis=1, name=name)
        else:
            load_into_slice(param, loaded, start, size, axis=0, name=name)


class MergedColumnParallelLinear(_FusedColumnLinear):
    """Projections such as gate and up fused into one matmul; shards are numbered 0, 1, ...

    ``output_sizes`` are the whole projections'; each rank holds its share of every one.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size = get_tensor_model_parallel_world_size()
        local = {i: divide(size, tp_size, f"{prefix or 'the layer'}'s output size") for i, size in
                 enumerate(output_sizes)}
        super().__init__(input_size, local, bias, dtype, quant_config, prefix)
        self.output_sizes = list(output_sizes)


class QKVParallelLinear(_FusedColumnLinear):
    """Q, K and V projections fused into one matmul: output ``[q | k | v]``; shards "q", "k", "v".

    Under tensor parallelism each rank holds ``num_heads / tp`` query heads and the KV heads they
    attend with: a share of the KV heads, or, where there are fewer KV heads than ranks, one KV
    head replicated on ``tp / num_kv_heads`` ranks (vLLM's layout). ``num_heads`` and
    ``num_kv_heads`` are this rank's.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        dtype: str = "float32",
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        total_kv = total_num_kv_heads or total_num_heads
        heads = divide(total_num_heads, tp_size, "num_attention_heads")
        kv_heads = kv_heads_per_rank(total_kv, tp_size)
        # The first KV head of this rank: its share, or the head its replicas share.
        kv_start = tp_rank * kv_heads if total_kv >= tp_size else tp_rank // (tp_size // total_kv)
        sizes = {"q": heads * head_size, "k": kv_heads * head_size, "v": kv_heads * head_size}
        starts = {"q": tp_rank * sizes["q"], "k": kv_start * head_size, "v": kv_start * head_size}
        super().__init__(hidden_size, sizes, bias, dtype, quant_config, prefix, starts)
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_kv
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.q_size = sizes["q"]
        self.kv_size = sizes["k"]

    def checkpoint_shard_sizes(self) -> dict[object, int]:
        d = self.head_size
        return {"q": self.total_num_heads * d, "k": self.total_num_kv_heads * d, "v": self.total_num_kv_heads * d}
