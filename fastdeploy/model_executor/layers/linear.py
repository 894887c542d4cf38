"""Linear layers with vLLM's names. Weights are stored ``[in, out]`` so the forward is one ``paddle.matmul``.

Tensor parallelism is not implemented yet (tp size 1): the Column/Row variants differ
only in how a checkpoint is loaded into them. Checkpoint weights arrive in Hugging
Face's ``[out, in]`` layout and are transposed once at load time.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

from fastdeploy.model_executor.utils import load_into, load_into_slice, new_parameter


class LinearBase(nn.Layer):
    """``y = x @ W (+ b)`` with ``W`` of shape ``[input_size, output_size]``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, dtype: str = "float32") -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = new_parameter([input_size, output_size], dtype)
        self.bias = new_parameter([output_size], dtype) if bias else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = paddle.matmul(x, self.weight)
        # A separate add: F.linear's fused path is slower than matmul + add on CPU.
        return out if self.bias is None else out + self.bias

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
