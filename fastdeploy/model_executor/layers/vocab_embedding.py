"""Token embedding and LM head (vLLM's names; one tensor-parallel rank for now)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy.model_executor.layers.linear import LinearBase
from fastdeploy.model_executor.utils import load_into, new_parameter

if TYPE_CHECKING:
    from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig


class VocabParallelEmbedding(nn.Layer):
    """Embedding table ``[num_embeddings, embedding_dim]``, rows looked up by token id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: str = "float32") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = new_parameter([num_embeddings, embedding_dim], dtype)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        return F.embedding(input_ids, self.weight)

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load the HF embedding table ``[vocab, hidden]``."""
        load_into(param, loaded, type(self).__name__)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(LinearBase):
    """Output projection to the vocabulary, stored ``[hidden, vocab]`` for a plain matmul.

    With tied embeddings the table is copied transposed from the embedding at load time:
    on CPU ``matmul(x, W)`` is ~1.7x faster than ``matmul(x, E, transpose_y=True)`` at
    batch 1, which is worth the extra copy of the table. Like the linear layers, the head
    runs on its linear method (packed for the linear kernel after loading).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(embedding_dim, num_embeddings, bias, dtype, quant_config, prefix)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Copy the embedding table (tied word embeddings)."""
        self.weight.set_value(paddle.transpose(embed_tokens.weight, [1, 0]))
        return self

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, bias={self.bias is not None}"
