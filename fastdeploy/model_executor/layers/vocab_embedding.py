"""Token embedding and LM head (vLLM's names), split over the tensor-parallel ranks by vocabulary rows.

The vocabulary is padded to a multiple of the ranks and each rank holds one contiguous range
of rows (the same range in the embedding and the head, so a tied head copies its own rows).
The embedding looks up the ids in its range, zeros the others and sums over the ranks (one
all-reduce); the head computes its range's logits, which ``LogitsProcessor`` gathers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from fastdeploy.model_executor.layers.linear import ColumnParallelLinear
from fastdeploy.model_executor.layers.tp_shard import shard_tensor
from fastdeploy.model_executor.utils import load_into, new_parameter

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig


class VocabParallelEmbedding(nn.Layer):
    """Embedding table ``[num_embeddings, embedding_dim]``, rows looked up by token id.

    Args:
        quant_config: the model's quantization config; a method it gives for this layer
            keeps the table in its own form and looks rows up itself (e.g. GGUF blocks).
        prefix: the layer's checkpoint name, for the quantization config.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_size, self.tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        self.num_embeddings_per_partition, self.vocab_start_index = vocab_range(num_embeddings, self.tp_size,
                                                                                self.tp_rank)
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        object.__setattr__(self, "quant_method", method)
        if method is not None:
            method.create_weights(self, self.num_embeddings_per_partition, embedding_dim, dtype)
        else:
            self.weight = new_parameter([self.num_embeddings_per_partition, embedding_dim], dtype)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        if self.tp_size > 1:
            return self._forward_partitioned(input_ids)
        if self.quant_method is not None:
            return self.quant_method.apply(self, input_ids)
        return F.embedding(input_ids, self.weight)

    def _forward_partitioned(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        start = self.vocab_start_index
        local = input_ids - start
        mine = (local >= 0) & (local < self.num_embeddings_per_partition)
        local = paddle.where(mine, local, paddle.zeros_like(local))
        rows = self.quant_method.apply(self, local) if self.quant_method is not None else F.embedding(local, self.weight)
        rows = rows * mine.unsqueeze(-1).astype(rows.dtype)
        return tensor_model_parallel_all_reduce(rows)

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load this rank's rows of the HF embedding table ``[vocab, hidden]``."""
        if self.tp_size > 1:
            loaded = shard_tensor(loaded, 0, self.vocab_start_index, self.num_embeddings_per_partition,
                                  type(self).__name__)
        if self.quant_method is not None and self.quant_method.weight_loader(self, param, loaded, shard_id):
            return
        load_into(param, loaded, type(self).__name__)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


def vocab_range(num_embeddings: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(rows per rank, this rank's first row) of a vocabulary padded to a multiple of ``tp_size``."""
    per_rank = -(-num_embeddings // tp_size)
    return per_rank, tp_rank * per_rank


class ParallelLMHead(ColumnParallelLinear):
    """Output projection to the vocabulary, stored ``[hidden, vocab]`` for a plain matmul.

    Column-parallel over the (padded) vocabulary: each rank computes the logits of its
    embedding rows; padding rows are zeros and dropped after the gather.

    With tied embeddings the unquantized method copies the table transposed from the
    embedding at load time (``UnquantizedLinearMethod.tie_weights``); GGUF multiplies with
    the embedding's blocks. Like the linear layers, the head runs on its linear method
    (packed for the linear kernel after loading).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size, tp_rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        per_rank, start = vocab_range(num_embeddings, tp_size, tp_rank)
        super().__init__(embedding_dim, per_rank, bias, dtype, quant_config, prefix, partitioned=True)
        self.vocab_start_index, self.num_embeddings_per_partition = start, per_rank
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load this rank's vocabulary rows of HF's ``lm_head.weight`` ``[vocab, hidden]`` (zeros past the end)."""
        if self.tp_size > 1:
            loaded = shard_tensor(loaded, 0, self.vocab_start_index, self.output_size, type(self).__name__)
        super(ColumnParallelLinear, self).weight_loader(param, loaded, shard_id)

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Multiply with the embedding table (tied word embeddings): a transposed copy, or its own blocks."""
        self.quant_method.tie_weights(self, embed_tokens)
        return self

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, bias={self.bias is not None}"
