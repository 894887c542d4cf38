"""Hidden states -> fp32 logits."""

from __future__ import annotations

import paddle
from paddle import nn

from fastdeploy.distributed.parallel_state import tensor_model_parallel_all_gather
from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead


class LogitsProcessor(nn.Layer):
    """Apply the LM head, then scale / soft-cap / drop vocabulary padding, returning fp32.

    Args:
        vocab_size: logits columns to keep (the head may be padded past the real vocabulary).
        org_vocab_size: accepted for vLLM compatibility.
        scale: multiplier applied to the logits (some models scale them).
        soft_cap: ``cap * tanh(logits / cap)`` when set (Gemma-style).
    """

    def __init__(
        self,
        vocab_size: int,
        org_vocab_size: int | None = None,
        scale: float = 1.0,
        soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.org_vocab_size = org_vocab_size or vocab_size
        self.scale = scale
        self.soft_cap = soft_cap

    def forward(self, lm_head: ParallelLMHead, hidden_states: paddle.Tensor) -> paddle.Tensor:
        """``hidden_states`` ``[S, hidden]`` -> logits ``[S, vocab_size]`` float32."""
        # Each tensor-parallel rank computed its vocabulary range: every rank gets them all.
        logits = tensor_model_parallel_all_gather(lm_head(hidden_states), axis=-1)
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        if logits.shape[-1] > self.vocab_size:
            logits = logits[..., : self.vocab_size]
        if self.soft_cap is not None:
            logits = paddle.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
