"""Runs one scheduler step: build the flattened batch, forward once, sample.

The batch is laid out without padding as ``[num_tokens, hidden]``: first the
decode rows (one query token each), then each prefill chunk. Positions, slot
mapping and block-table lookups are computed with numpy over the persistent
:class:`InputBatch` buffers.
"""

from __future__ import annotations

import time

import numpy as np
import paddle

from fastdeploy.config import FDConfig
from fastdeploy.engine.request import LogprobsLists
from fastdeploy.engine.sched.output import SchedulerOutput
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.attention.kv_cache_spec import (
    FullAttentionSpec,
    kv_cache_bytes_per_block,
    model_kv_cache_specs,
)
from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata
from fastdeploy.model_executor.layers.sampler import LogprobsArrays, Sampler, logprobs_of_rows
from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.platforms import huge_pages
from fastdeploy.platforms.huge_pages import back_with_huge_pages, tensor_buffers
from fastdeploy.spec_decode.drafter import Drafter
from fastdeploy.spec_decode.spec_batch import accept_verified, output_rows, spec_grammar_rows, write_draft_tokens
from fastdeploy.worker.input_batch import CachedRequestState, InputBatch
from fastdeploy.worker.model_runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

logger = init_logger(__name__)

_UINT64_MASK = (1 << 64) - 1


def _split_logprobs(
    arrays: LogprobsArrays, req_ids: list[str], ends: np.ndarray, num_logprobs: np.ndarray, vocab_size: int
) -> dict[str, LogprobsLists]:
    """Per request, its run of rows (ending at ``ends[i]``) as plain lists, with the chosen token and its top-k.

    The arrays hold the largest k of the step; each request keeps its own ``num_logprobs`` of them.
    One list per request is what the scheduler consumes, so this is the one loop over requests.
    """
    widths = (np.minimum(num_logprobs, vocab_size) + 1).tolist()
    starts = (ends - np.diff(ends, prepend=0)).tolist()
    entry_ranks = arrays.entry_ranks
    return {
        req_id: LogprobsLists(
            arrays.token_ids[a:b, :w].tolist(), arrays.logprobs[a:b, :w].tolist(), arrays.ranks[a:b].tolist(),
            None if entry_ranks is None else entry_ranks[a:b, :w].tolist(),
        )
        for req_id, a, b, w in zip(req_ids, starts, ends.tolist(), widths, strict=True)
    }


def _host_view(tensor: paddle.Tensor) -> np.ndarray:
    """A read-only numpy view of a CPU tensor's memory (DLPack), without ``.numpy()``'s copy."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return np.from_dlpack(tensor)


class ModelRunner:
    """Owns the model, its paged KV cache and the persistent batch of one device."""

    def __init__(self, fd_config: FDConfig) -> None:
        self.fd_config = fd_config
        mc = fd_config.model_config
        self.model_config = mc
        self.block_size = fd_config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.max_num_reqs = fd_config.scheduler_config.max_num_seqs
        self.vocab_size = mc.vocab_size
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler(kernels=get_op_backend().sampler == "csrc")
        self.model = None
        self.kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]] = []
        self.input_batch = InputBatch(
            self.max_num_reqs, self.max_model_len, -(-self.max_model_len // self.block_size), self.vocab_size
        )
        self._seed = mc.seed
        # Speculative decoding: the proposer, and the drafts the scheduler sends back verified.
        self.drafter = Drafter(fd_config) if fd_config.speculative_config is not None else None
        # Multimodal models: M-RoPE positions and the encoder cache (fastdeploy.multimodal.runner).
        self.mm_state = None
        # Whether the weights went to 2 MB pages at load. The KV cache keeps 4 KB pages: advised, its
        # blocks' first writes faulted in whole 2 MB pages during serving, and 16 streams ran 5-8% slower
        # (benchmarks/benchmark_huge_pages.py's steps reuse their blocks and did not show it).
        self.huge_pages = False

    # ---- set-up ------------------------------------------------------------------------
    def load_model(self) -> None:
        if self._seed is not None:
            paddle.seed(self._seed)
        self.model = get_model(self.model_config, self.fd_config.load_config)
        self.model.eval()
        if self.drafter is not None:
            self.drafter.load_model(self.model)
        if getattr(self.model, "supports_multimodal", False):
            from fastdeploy.multimodal.runner import MultiModalRunnerState

            self.mm_state = MultiModalRunnerState(self.model)
        self.huge_pages = get_op_backend().huge_pages and self._weights_to_huge_pages()

    def _weights_to_huge_pages(self) -> bool:
        """Move the loaded (and packed) weights to 2 MB pages, every decode step streams all of them;
        False (4 KB pages kept) for a model too small to gain (``huge_pages.MIN_MODEL_BYTES``)."""
        start = time.perf_counter()
        weights = tensor_buffers([self.model] + (self.drafter.models() if self.drafter is not None else []))
        if sum(size for _, size in weights) < huge_pages.MIN_MODEL_BYTES:
            return False
        result = back_with_huge_pages(weights)
        if result.error:
            logger.info("Weights: %d MB in 2 MB pages; the rest stay in 4 KB pages (madvise: %s).",
                        result.collapsed >> 20, result.error)
        else:
            logger.info("Weights: %d MB moved to 2 MB pages in %.2f s.", result.collapsed >> 20,
                        time.perf_counter() - start)
        return True

    @property
    def kv_cache_dtype(self) -> str:
        """The model's choice (bf16 for a bf16 model on the C++ kernels), float32 before loading."""
        return getattr(self.model, "kv_cache_dtype", None) or "float32"

    def kv_cache_specs(self) -> list[FullAttentionSpec]:
        """One spec per attention layer: the model's own (``get_kv_cache_spec``, e.g. MLA's latent),
        else K and V of ``num_kv_heads x head_dim`` per layer from the config."""
        mc = self.model_config
        # K and V of this tensor-parallel rank's KV heads (a share, or one replicated head).
        num_kv_heads = mc.get_num_kv_heads(self.fd_config.parallel_config)
        return model_kv_cache_specs(self.model, num_kv_heads, mc.head_dim, mc.num_layers, self.kv_cache_dtype)

    def kv_cache_bytes_per_block(self) -> int:
        own = kv_cache_bytes_per_block(self.kv_cache_specs(), self.block_size)
        return own + (self.drafter.kv_cache_bytes_per_block() if self.drafter is not None else 0)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate each layer's cache tensors as its spec says (K and V as
        ``[num_blocks, block_size, num_kv_heads, head_dim]`` for full attention).

        ``paddle.empty`` leaves pages untouched until written, so a large
        budget costs memory only as it fills.
        """
        self.kv_caches = [spec.allocate(num_blocks, self.block_size) for spec in self.kv_cache_specs()]
        if self.drafter is not None:
            self.drafter.initialize_kv_cache(num_blocks)

    # ---- batch state -------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            if self.drafter is not None:
                self.drafter.finish_request(req_id, batch)
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
            if self.mm_state is not None:
                self.mm_state.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is None:
                sp = new.sampling_params
                # Any int64 is a seed (vLLM's torch generators read it as uint64); numpy's must be non-negative.
                gen = np.random.default_rng(sp.seed & _UINT64_MASK) if sp.seed is not None else None
                state = CachedRequestState(
                    new.req_id, sp, new.num_prompt_tokens, new.eos_token_id, gen, new.bad_words_token_ids
                )
                self.requests[new.req_id] = state
            if self.mm_state is not None:
                self.mm_state.add_request(new.req_id, new.token_ids, new.num_prompt_tokens, new.mm_features)
            # Outputs generated before a preemption come back in token_ids; the row rebuilds its
            # penalty counts from them.
            batch.add_request(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.num_computed_tokens,
                new.block_ids,
                state.sampling_params,
                eos_token_id=state.eos_token_id,
                generator=state.generator,
                bad_words_token_ids=state.bad_words_token_ids,
            )
        for cached in so.scheduled_cached_reqs:
            row = batch.req_id_to_index[cached.req_id]
            batch.num_computed_tokens[row] = cached.num_computed_tokens
            if cached.new_block_ids:
                batch.append_block_ids(row, cached.new_block_ids)

    # ---- one step ----------------------------------------------------------------------
    @paddle.no_grad()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        bs = self.block_size

        # Decodes (one token) first, then prefill chunks (a stable order, as sorted() would give).
        num_sched = so.num_scheduled_tokens
        req_ids = list(num_sched)
        n = np.fromiter(num_sched.values(), dtype=np.int64, count=len(req_ids))
        rows = np.fromiter(map(batch.req_id_to_index.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))
        is_prefill = n != 1
        if (is_prefill[:-1] & ~is_prefill[1:]).any():  # some prefill is scheduled before a decode
            order = np.argsort(is_prefill, kind="stable")
            req_ids = [req_ids[i] for i in order.tolist()]
            n, rows = n[order], rows[order]
        computed = batch.num_computed_tokens[rows]
        # Draft tokens to verify sit after each request's known tokens: [last token, d_1..d_k].
        spec = so.scheduled_spec_decode_tokens
        num_drafts = write_draft_tokens(batch, spec, req_ids, rows) if spec else None
        cu_end = np.cumsum(n)
        starts = cu_end - n
        seq_lens = computed + n
        # Only the block-table columns this step reaches travel to the kernels.
        block_tables = batch.block_table[rows, : -(-int(seq_lens.max()) // bs)]
        meta, positions = build_attention_metadata(block_tables, n, seq_lens, bs)
        input_ids = batch.token_ids[np.repeat(rows, n), positions]

        mm_kwargs = self.mm_state.step_inputs(req_ids, computed, n) if self.mm_state is not None else {}
        hidden = self.model(paddle.to_tensor(input_ids), paddle.to_tensor(positions), self.kv_caches, meta,
                            **mm_kwargs)
        if self.drafter is not None:
            self.drafter.observe(input_ids, positions, meta, hidden, np.repeat(rows, n), req_ids, starts, computed)

        # Requests whose chunk reaches their last known token (and drafts) sample the next one.
        sample_mask = computed + n >= batch.num_tokens[rows] + (0 if num_drafts is None else num_drafts)
        out = ModelRunnerOutput()
        self._prompt_logprobs(req_ids, rows, computed, n, starts, hidden, out)
        if not sample_mask.any():
            if self.drafter is not None:  # MTP still reads the step (its cache)
                self.drafter.propose(batch, [], rows[:0], len(req_ids))
            return out
        s_idx = np.flatnonzero(sample_mask)
        s_req_ids = req_ids if len(s_idx) == len(req_ids) else [req_ids[i] for i in s_idx.tolist()]
        s_rows = rows[s_idx]
        # Logits at the last position of each request, or at every verified position of a spec request.
        num_pos = None if num_drafts is None else num_drafts[s_idx] + 1
        last_rows = cu_end[s_idx] - 1 if num_pos is None else output_rows(cu_end[s_idx] - num_pos, num_pos)
        # A decode-only step samples every row in order: no gather needed.
        if len(last_rows) != len(hidden) or last_rows[-1] != len(last_rows) - 1:
            hidden = paddle.gather(hidden, paddle.to_tensor(last_rows))
        logits = self.model.compute_logits(hidden).numpy()
        # One row of settings per verified position, in the state that position sees (drafts before it as outputs).
        md = batch.make_sampling_metadata(s_rows, num_pos)
        # Structured outputs: the scheduler's grammar bitmask, reordered to this step's sampled rows.
        md.grammar_bitmask, md.grammar_rows = (so.grammar_rows(s_req_ids) if num_pos is None
                                               else spec_grammar_rows(so, s_req_ids, num_pos))
        # The logits array is this step's own: the sampler may overwrite it instead of copying.
        result = self.sampler(logits, md, inplace=True)
        sampled = result.sampled_token_ids
        lp = result.logprobs
        if num_pos is None:
            counts = np.ones(len(s_rows), dtype=np.int64)
            batch.append_sampled(s_rows, sampled)
            out.sampled_token_ids = dict(zip(s_req_ids, sampled[:, None].tolist(), strict=True))
        else:
            # Verification: each request keeps its accepted drafts and the target's token after them.
            counts, sampled, lp, out.sampled_token_ids = accept_verified(batch, s_rows, s_req_ids, spec, num_pos,
                                                                         sampled, lp)
        if lp is not None:
            k = batch.num_logprobs[s_rows]
            with_lp = np.flatnonzero(k >= 0)
            if len(with_lp) < len(k):
                lp = lp.take(output_rows(np.cumsum(counts)[with_lp] - counts[with_lp], counts[with_lp]))
            out.logprobs = _split_logprobs(
                lp, [s_req_ids[j] for j in with_lp.tolist()], np.cumsum(counts[with_lp]), k[with_lp],
                self.vocab_size,
            )
        if self.drafter is not None:
            out.spec_token_ids = self.drafter.propose(batch, s_req_ids, s_rows, len(req_ids))
        return out

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        computed: np.ndarray,
        n: np.ndarray,
        starts: np.ndarray,
        hidden: paddle.Tensor,
        out: ModelRunnerOutput,
    ) -> None:
        """Logprobs of the prompt tokens this chunk predicts (token i+1 from position i), all requests in one call."""
        batch = self.input_batch
        k = batch.num_prompt_logprobs[rows]
        if (k < 0).all():
            return
        first = computed
        end = np.minimum(computed + n, batch.num_prompt_tokens[rows] - 1)
        count = np.where(k >= 0, np.maximum(end - first, 0), 0)
        sel = np.flatnonzero(count)
        if not len(sel):
            return
        count = count[sel]
        ends = np.cumsum(count)
        offset = np.arange(int(ends[-1])) - np.repeat(ends - count, count)
        hidden_rows = np.repeat(starts[sel], count) + offset
        targets = batch.token_ids[np.repeat(rows[sel], count), np.repeat(first[sel], count) + 1 + offset]
        logits = self.model.compute_logits(paddle.gather(hidden, paddle.to_tensor(hidden_rows)))
        # A read-only view, not a copy: .numpy() of a 600-token prompt's logits copies 118 MB into
        # fresh pages (0.1 s); the rows are only read.
        lp = logprobs_of_rows(_host_view(logits), targets, int(k[sel].max()))
        out.prompt_logprobs = _split_logprobs(lp, [req_ids[i] for i in sel.tolist()], ends, k[sel], self.vocab_size)
