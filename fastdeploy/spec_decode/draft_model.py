"""A draft model: a second, smaller model with the target's tokenizer, run k steps per engine step.

Its paged KV cache has the target's block ids (one block table serves both, so prefix-cache
hits, preemption and rollback need nothing of their own): every engine step it first runs the
target's own flattened input (keeping its cache in step with the tokens the target computed,
accepted drafts included), then k one-token steps from each request's newest token, taking the
argmax each time (vLLM's ``draft_sample_method="greedy"``: q is one-hot, which the rejection
sampler's exact rule expects). The KV slots of those k steps are the scheduler's lookahead slots.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.config import LoadConfig, ModelConfig
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.layers.attention.kv_cache_spec import (
    FullAttentionSpec,
    kv_cache_bytes_per_block,
    model_kv_cache_specs,
)
from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata, build_attention_metadata
from fastdeploy.spec_decode.config import SpeculativeConfig

logger = init_logger(__name__)


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's ModelConfig (read at start-up); another vocabulary than the target's is a ValueError."""
    assert spec.model is not None
    draft = ModelConfig(model=spec.model, dtype=target.dtype, seed=target.seed, revision=spec.revision,
                        max_model_len=target.max_model_len, trust_remote_code=target.trust_remote_code,
                        skip_tokenizer_init=True)
    from fastdeploy.model_executor.models.sliding_window import check_sliding_window

    check_sliding_window(draft)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"The draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, the target "
                         f"{target.model!r} one of {target.vocab_size}: draft_model needs the same tokenizer.")
    return draft


class DraftModelProposer:
    """Owns the draft model and its KV cache; proposes k greedy drafts per request."""

    def __init__(self, spec: SpeculativeConfig, model_config: ModelConfig, load_config: LoadConfig,
                 block_size: int) -> None:
        from fastdeploy.model_executor.model_loader import get_model

        self.k = spec.num_speculative_tokens
        self.model_config = model_config
        self.block_size = block_size
        self.model = get_model(model_config, load_config)
        self.model.eval()
        self.kv_caches: list[tuple[paddle.Tensor, ...]] = []

    @property
    def kv_cache_dtype(self) -> str:
        return getattr(self.model, "kv_cache_dtype", None) or "float32"

    def kv_cache_specs(self) -> list[FullAttentionSpec]:
        """The draft's cache per layer as the model describes it (an MLA draft: its latent), like the target's."""
        mc = self.model_config
        return model_kv_cache_specs(self.model, mc.num_kv_heads, mc.head_dim, mc.num_layers, self.kv_cache_dtype)

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.kv_cache_specs(), self.block_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [spec.allocate(num_blocks, self.block_size) for spec in self.kv_cache_specs()]

    def observe(self, input_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata) -> None:
        """Run the target's step input through the draft, filling its KV cache at the same slots."""
        self.model(paddle.to_tensor(input_ids), paddle.to_tensor(positions), self.kv_caches, meta)

    def propose(self, last_tokens: np.ndarray, num_tokens: np.ndarray, block_tables: np.ndarray,
                max_drafts: np.ndarray) -> list[list[int]]:
        """k greedy drafts per row, from its newest token.

        Args:
            last_tokens: ``[R]`` each row's newest token (at position ``num_tokens - 1``, not yet in the cache).
            num_tokens: ``[R]`` each row's length.
            block_tables: ``[R, blocks]`` the rows' block ids (with the lookahead blocks).
            max_drafts: ``[R]`` how many drafts each row may have (<= k).
        """
        steps = int(max_drafts.max()) if len(max_drafts) else 0
        drafts = np.zeros((len(last_tokens), max(steps, 0)), dtype=np.int64)
        tokens = last_tokens.astype(np.int64)
        for i in range(steps):
            # Only rows that may still draft step: the others' lookahead slots may not exist.
            active = np.flatnonzero(max_drafts > i)
            seq_lens = num_tokens[active] + i
            cols = -(-int(seq_lens.max()) // self.block_size)
            meta, positions = build_attention_metadata(block_tables[active, :cols], np.ones(len(active), np.int64),
                                                       seq_lens, self.block_size)
            hidden = self.model(paddle.to_tensor(tokens[active]), paddle.to_tensor(positions), self.kv_caches, meta)
            tokens[active] = self.model.compute_logits(hidden).numpy().argmax(axis=-1)
            drafts[active, i] = tokens[active]
        return [drafts[r, : int(max_drafts[r])].tolist() for r in range(len(last_tokens))]
