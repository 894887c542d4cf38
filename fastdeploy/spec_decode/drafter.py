"""The model runner's side of speculative decoding: which requests draft, and from which proposer.

After each step's sampling the runner hands the requests that sampled to :meth:`Drafter.propose`;
their drafts go back to the scheduler with the step's output (vLLM's ``draft_token_ids``) and
return, validated and within the token budget, as next step's ``scheduled_spec_decode_tokens``.

Every request drafts, penalised ones too: repetition/presence/frequency penalties, bad words and
``min_tokens`` read the output so far, and verification samples each position in the state it
would have with the drafts before it accepted (``InputBatch.make_sampling_metadata``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fastdeploy.logger import init_logger
from fastdeploy.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig
    from fastdeploy.model_executor.layers.attention.metadata import AttentionMetadata
    from fastdeploy.worker.input_batch import InputBatch

logger = init_logger(__name__)


class Drafter:
    """Builds the configured proposer and asks it for drafts each step."""

    def __init__(self, fd_config: FDConfig) -> None:
        spec: SpeculativeConfig = fd_config.speculative_config
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.max_model_len = fd_config.model_config.max_model_len
        self.block_size = fd_config.cache_config.block_size
        self.fd_config = fd_config
        self.ngram = self.suffix = self.draft_model = self.mtp = None
        # MTP: the step's flattened input (token rows, positions, metadata, target hidden, step
        # index of each request), run through the modules once the step's tokens are verified.
        self._step: tuple | None = None
        if spec.method == "ngram":
            from fastdeploy.spec_decode.ngram_proposer import NgramProposer

            self.ngram = NgramProposer(self.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec.method == "suffix":
            from fastdeploy.spec_decode.suffix_proposer import SuffixProposer

            self.suffix = SuffixProposer(self.k, spec.suffix_decoding_max_tree_depth,
                                         spec.suffix_decoding_max_cached_requests,
                                         spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)

    # ---- draft model set-up ---------------------------------------------------------------
    def load_model(self, target=None) -> None:
        """Build a model-based proposer (``target``: the loaded target model, for MTP)."""
        if self.spec.method == "mtp":
            from fastdeploy.spec_decode.mtp_proposer import MtpProposer

            self.mtp = MtpProposer(self.k, target, self.fd_config)
            logger.info("Speculative decoding: the checkpoint's MTP modules, %d tokens per step.", self.k)
        elif self.spec.method == "draft_model":
            from fastdeploy.spec_decode.draft_model import DraftModelProposer

            self.draft_model = DraftModelProposer(self.spec, self.fd_config.draft_model_config,
                                                  self.fd_config.load_config, self.block_size)
            logger.info("Speculative decoding: draft model %s, %d tokens per step.", self.spec.model, self.k)
        else:
            logger.info("Speculative decoding: %s, %d tokens per step.", self.spec.method, self.k)

    def models(self) -> list:
        """The Layers a model-based proposer runs each step (the draft model, or the MTP modules)."""
        if self.draft_model is not None:
            return [self.draft_model.model]
        return [self.mtp.mtp] if self.mtp is not None else []

    def kv_cache_bytes_per_block(self) -> int:
        """The draft model's share of a KV block (its cache has the target's block ids)."""
        proposer = self.draft_model or self.mtp
        return 0 if proposer is None else proposer.kv_cache_bytes_per_block()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        for proposer in (self.draft_model, self.mtp):
            if proposer is not None:
                proposer.initialize_kv_cache(num_blocks)

    def observe(self, input_ids: np.ndarray, positions: np.ndarray, meta: AttentionMetadata, hidden=None,
                token_rows: np.ndarray | None = None, req_ids: list[str] | None = None,
                starts: np.ndarray | None = None, computed: np.ndarray | None = None) -> None:
        """The target's step input: a draft model runs it now, MTP keeps it for after verification."""
        if self.draft_model is not None:
            self.draft_model.observe(input_ids, positions, meta)
        if self.mtp is not None:
            assert req_ids is not None and starts is not None and computed is not None
            index = {r: i for i, r in enumerate(req_ids)}
            self._step = (token_rows, positions, meta, hidden, index, starts, computed)

    def finish_request(self, req_id: str, batch: InputBatch) -> None:
        """A request leaves for good (the suffix proposer keeps its output for the global tree)."""
        if self.suffix is None:
            return
        row = batch.req_id_to_index.get(req_id)
        if row is None:
            self.suffix.finish(req_id, [])
            return
        out = batch.token_ids[row, batch.num_prompt_tokens[row] : batch.num_tokens[row]].tolist()
        self.suffix.finish(req_id, out)

    # ---- per step -------------------------------------------------------------------------
    def propose(self, batch: InputBatch, req_ids: list[str], rows: np.ndarray, num_scheduled_reqs: int,
                ) -> dict[str, list[int]]:
        """Drafts for the requests that sampled this step (rows of ``batch``, their tokens appended)."""
        if self.mtp is not None and self._step is not None:
            # Every step's positions go through the modules (their cache), drafts or not.
            token_rows, positions, meta, hidden, _, _, _ = self._step
            self.mtp.observe(batch.token_ids, token_rows, positions, meta, hidden)
        limit = self.spec.disable_by_batch_size
        if limit is not None and num_scheduled_reqs > limit:
            return {}
        # Positions num_tokens .. num_tokens + k - 1 must exist (the verification writes them).
        room = np.minimum(self.max_model_len - batch.num_tokens[rows], self.k)
        sel = np.flatnonzero(room > 0)
        if not len(sel):
            return {}
        e_rows = rows[sel]
        num_tokens = batch.num_tokens[e_rows]
        if self.ngram is not None:
            drafts = self.ngram.propose(batch.token_ids[e_rows], num_tokens)
        elif self.suffix is not None:
            drafts = [self.suffix.propose(req_ids[i], batch.token_ids[r, :n].tolist())
                      for i, r, n in zip(sel.tolist(), e_rows.tolist(), num_tokens.tolist(), strict=True)]
        elif self.mtp is not None:
            assert self._step is not None
            _, _, _, _, index, starts, computed = self._step
            at = np.fromiter((index[req_ids[i]] for i in sel.tolist()), dtype=np.int64, count=len(sel))
            # The last accepted position (P - 1, P: the newest token's) as an index into the step's tokens.
            last_index = starts[at] + num_tokens - 2 - computed[at]
            width = -(-int((num_tokens + room[sel]).max()) // self.block_size)
            drafts = self.mtp.propose(last_index, num_tokens, batch.block_table[e_rows, :width], room[sel])
        else:
            assert self.draft_model is not None
            width = -(-int((num_tokens + room[sel]).max()) // self.block_size)
            drafts = self.draft_model.propose(batch.token_ids[e_rows, num_tokens - 1], num_tokens,
                                              batch.block_table[e_rows, :width], room[sel])
        out = {}
        for i, d, r in zip(sel.tolist(), drafts, room[sel].tolist(), strict=True):
            if d:
                out[req_ids[i]] = d[:r]
        return out
