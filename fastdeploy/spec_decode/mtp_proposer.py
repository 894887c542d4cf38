"""MTP drafts: the next-token-prediction modules a DeepSeek-V3 checkpoint carries (``num_nextn_predict_layers``).

The modules share the target's embedding and LM head and keep their own latent caches, indexed
by the target's block ids. Each engine step, after verification, they run over the step's input
positions: position i pairs the target's hidden state h_i with the now-known token t_{i+1}
(prompt, accepted draft or the new token), which fills their cache and, at each request's last
accepted position, predicts the first draft. Further drafts feed the module its own output hidden
state (the target's is not known there yet), one token and module ``j % D`` per step, as vLLM's
MTP proposer does; those positions' cache rows are the scheduler's lookahead slots and are
written again, with the target's states, by the next step. Drafts are greedy (q one-hot).
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.config import FDConfig
from fastdeploy.model_executor.layers.attention.kv_cache_spec import kv_cache_bytes_per_block
from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata, build_attention_metadata


def check_mtp_target(fd_config: FDConfig) -> None:
    """Start-up check: the target must carry MTP modules."""
    hf = fd_config.model_config.hf_config
    layers = int(getattr(hf, "num_nextn_predict_layers", 0) or 0)
    if layers < 1:
        arch = (getattr(hf, "architectures", None) or ["?"])[0]
        raise ValueError(f"Speculative method 'mtp' needs a checkpoint with MTP modules (num_nextn_predict_layers "
                         f">= 1, as DeepSeek-V3 has); {fd_config.model_config.model!r} ({arch}) has none.")


class MtpProposer:
    """Owns the MTP modules (built on the loaded target) and their caches."""

    def __init__(self, num_speculative_tokens: int, target, fd_config: FDConfig) -> None:
        from fastdeploy.model_executor.models.deepseek_mtp import DeepSeekMTP

        self.k = num_speculative_tokens
        self.block_size = fd_config.cache_config.block_size
        self.mtp = DeepSeekMTP.from_target(target, fd_config.model_config, fd_config.load_config.load_format)
        self.kv_caches: list = []
        self._hidden: paddle.Tensor | None = None

    def kv_cache_bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.mtp.get_kv_cache_spec(), self.block_size)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = [spec.allocate(num_blocks, self.block_size) for spec in self.mtp.get_kv_cache_spec()]

    def observe(self, token_ids: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, meta: AttentionMetadata,
                hidden: paddle.Tensor) -> None:
        """Run the modules over the step's input (after verification: every t_{i+1} is known or stale)."""
        nxt = token_ids[token_rows, np.minimum(positions + 1, token_ids.shape[1] - 1)]
        self._hidden = self.mtp(paddle.to_tensor(nxt), paddle.to_tensor(positions), hidden, self.kv_caches, meta)

    def propose(self, last_index: np.ndarray, num_tokens: np.ndarray, block_tables: np.ndarray,
                max_drafts: np.ndarray) -> list[list[int]]:
        """Drafts for the proposing rows (after :meth:`observe` of the step).

        Args:
            last_index: ``[R]`` each row's last accepted position, as an index into the step's tokens.
            num_tokens, block_tables, max_drafts: per row, its length, blocks and draft limit.
        """
        h = paddle.gather(self._hidden, paddle.to_tensor(last_index))
        steps = int(max_drafts.max()) if len(max_drafts) else 0
        drafts = np.zeros((len(max_drafts), max(steps, 0)), dtype=np.int64)
        if steps:
            drafts[:, 0] = self.mtp.compute_logits(h).numpy().argmax(axis=-1)
        for j in range(1, steps):
            prev, active = np.flatnonzero(max_drafts > j - 1), np.flatnonzero(max_drafts > j)
            # Draft d_j sits at position P + j (P: the newest token's); the module reads it at P + j - 1.
            seq_lens = num_tokens[active] + j - 1
            cols = -(-int(seq_lens.max()) // self.block_size)
            step_meta, pos = build_attention_metadata(block_tables[active, :cols], np.ones(len(active), np.int64),
                                                      seq_lens, self.block_size)
            h = self.mtp(paddle.to_tensor(drafts[active, j - 1]), paddle.to_tensor(pos),
                         paddle.gather(h, paddle.to_tensor(np.searchsorted(prev, active))), self.kv_caches,
                         step_meta, spec_step_idx=j)
            drafts[active, j] = self.mtp.compute_logits(h, spec_step_idx=j).numpy().argmax(axis=-1)
        return [drafts[r, : int(max_drafts[r])].tolist() for r in range(len(max_drafts))]
