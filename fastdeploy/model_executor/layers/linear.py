"""Linear layers with vLLM's names. Weights are stored ``[in, out]`` so the forward is one ``paddle.matmul``.

Tensor parallelism is not implemented yet (tp size 1): the Column/Row variants differ
only in how a checkpoint is loaded into them. Checkpoint weights arrive in Hugging
Face's ``[out, in]`` layout and are transposed once at load time.

After loading, :meth:`PackedWeightMixin.process_weights_after_loading` converts each
weight once into the packed layout of the linear kernel (``csrc/cpu/linear.cc``), in bf16 or
fp32, and drops the fp32 parameter; the forward then runs that kernel (oneDNN on AMX /
AVX512-BF16 CPUs, the 16-column panel kernel of ``csrc/cpu/panel_gemm.cc`` on AVX2 ones;
fp32 accumulation either way). Without the kernel the weight stays and the forward is
``paddle.matmul``.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.utils import load_into, load_into_slice, new_parameter, param_dtype

# Compute dtypes the packed-weight kernel takes.
PACKED_DTYPES = ("float32", "bfloat16")


class PackedWeightMixin:
    """``y = x @ weight (+ bias)`` for a layer with ``weight`` ``[in, out]``, packable for the oneDNN kernel.

    After :meth:`process_weights_after_loading` the packed copy is the buffer ``packed_weight``
    and the fp32 ``weight`` parameter is gone (``weight`` is None).
    """

    # (packed, bias, out_features, dtype): the kernel's arguments in one plain attribute, because
    # Paddle resolves parameters and buffers through Layer.__getattr__ (~1 us per access).
    _packed_args: tuple | None = None
    _packed_in: int = 0  # K of the packed [K, N] weight

    @property
    def is_packed(self) -> bool:
        return self._packed_args is not None

    def process_weights_after_loading(self, dtype: str) -> bool:
        """Pack the loaded weight once for ``dtype`` ("float32" or "bfloat16"); False when the kernel is missing."""
        if self._packed_args is not None:
            return True
        weight = self.weight
        if dtype not in PACKED_DTYPES or weight is None or param_dtype(weight) != "float32":
            return False
        if not ops.has("fd_linear"):
            return False
        packed = ops.linear_pack(weight, dtype)
        self.register_buffer("packed_weight", packed, persistable=True)
        object.__setattr__(self, "_packed_args", (packed, self.bias, int(weight.shape[1]), dtype))
        object.__setattr__(self, "_packed_in", int(weight.shape[0]))
        # The packed copy replaces the fp32 weight: keeping both would double the weights' memory.
        self.weight = None
        return True

    def dense_weight(self) -> paddle.Tensor:
        """The ``[in, out]`` fp32 weight, unpacked again when packed (for inspection and export, not the forward)."""
        if self._packed_args is None:
            return self.weight
        packed, _, n, dtype = self._packed_args
        return ops.linear_unpack(packed, self._packed_in, n, dtype)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        """``x @ W (+ b)``: the packed kernel when packed, else ``paddle.matmul``."""
        if self._packed_args is not None:
            return ops.linear(x, *self._packed_args)
        out = paddle.matmul(x, self.weight)
        # A separate add: F.linear's fused path is slower than matmul + add on CPU.
        return out if self.bias is None else out + self.bias


class LinearBase(PackedWeightMixin, nn.Layer):
    """``y = x @ W (+ b)`` with ``W`` of shape ``[input_size, output_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: str = "float32") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = new_parameter([input_size, output_size], dtype)
        self.bias = new_parameter([output_size], dtype) if bias else None

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load a Hugging Face tensor (weight ``[out, in]`` or bias ``[out]``) into ``param``."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shards, got shard_id={shard_id!r}.")
        load_into(param, loaded.T if param is self.weight else loaded, type(self).__name__)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""


class ColumnParallelLinear(LinearBase):
    """Output dimension split across tensor-parallel ranks (one rank for now)."""


class RowParallelLinear(LinearBase):
    """Input dimension split across tensor-parallel ranks (one rank for now)."""


class _FusedColumnLinear(ColumnParallelLinear):
    """Several projections of the same input concatenated along the output dimension."""

    def __init__(self, input_size: int, shard_sizes: dict[object, int], bias: bool, dtype: str) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard, size in shard_sizes.items():
            self.shard_offsets[shard] = (offset, size)
            offset += size

    @property
    def shard_ids(self) -> tuple[object, ...]:
        """Shard ids that together fill the fused weight."""
        return tuple(self.shard_offsets)

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load one projection's HF tensor into its columns of the fused weight (or bias)."""
        if shard_id is None:  # an already fused checkpoint tensor
            super().weight_loader(param, loaded)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(
                f"Unknown shard {shard_id!r} for {type(self).__name__}; known: {list(self.shard_offsets)}."
            )
        start, size = self.shard_offsets[shard_id]
        name = f"{type(self).__name__}[{shard_id}]"
        if param is self.weight:
            load_into_slice(param, loaded.T, start, size, axis=1, name=name)
        else:
            load_into_slice(param, loaded, start, size, axis=0, name=name)


class MergedColumnParallelLinear(_FusedColumnLinear):
    """Projections such as gate and up fused into one matmul; shards are numbered 0, 1, ..."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, dtype: str = "float32") -> None:
        super().__init__(input_size, dict(enumerate(output_sizes)), bias, dtype)
        self.output_sizes = list(output_sizes)


class QKVParallelLinear(_FusedColumnLinear):
    """Q, K and V projections fused into one matmul: output ``[q | k | v]``; shards "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        dtype: str = "float32",
    ) -> None:
        kv_heads = total_num_kv_heads or total_num_heads
        sizes = {"q": total_num_heads * head_size, "k": kv_heads * head_size, "v": kv_heads * head_size}
        super().__init__(hidden_size, sizes, bias, dtype)
        self.head_size = head_size
        self.num_heads = total_num_heads
        self.num_kv_heads = kv_heads
        self.q_size = sizes["q"]
        self.kv_size = sizes["k"]
