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
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        object.__setattr__(self, "quant_method", method)
        if method is not None:
            method.create_weights(self, num_embeddings, embedding_dim, dtype)
        else:
            self.weight = new_parameter([num_embeddings, embedding_dim], dtype)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, input_ids)
        return F.embedding(input_ids, self.weight)

    def weight_loader(self, param: paddle.Tensor, loaded: np.ndarray, shard_id: object = None) -> None:
        """Load the HF embedding table ``[vocab, hidden]``."""
        if self.quant_method is not None and self.quant_method.weight_loader(self, param, loaded, shard_id):
            return
        load_into(param, loaded, type(self).__name__)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class ParallelLMHead(LinearBase):
    """Output projection to the vocabulary, stored ``[hidden, vocab]`` for a plain matmul.

    With tied embeddings the unquantized method copies the table transposed from the
    embedding at load time (``UnquantizedLinearMethod.tie_weights``); GGUF multiplies with
    the embedding's blocks. Like the linear layers, the head runs on its linear method
    (packed for the linear kernel after loading).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, dtype: str = "float32",
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(embedding_dim, num_embeddings, bias, dtype, quant_config, prefix)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> ParallelLMHead:
        """Multiply with the embedding table (tied word embeddings): a transposed copy, or its own blocks."""
        self.quant_method.tie_weights(self, embed_tokens)
        return self

    def extra_repr(self) -> str:
        return f"{self.embedding_dim} -> {self.num_embeddings}, bias={self.bias is not None}"
