"""Runs one scheduler step: build the flattened batch, forward once, sample.

The batch is laid out without padding as ``[num_tokens, hidden]``: first the
decode rows (one query token each), then each prefill chunk. Positions, slot
mapping and block-table lookups are computed with numpy over the persistent
:class:`InputBatch` buffers.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy.config import FDConfig
from fastdeploy.engine.request import LogprobsLists
from fastdeploy.engine.sched.output import SchedulerOutput
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata
from fastdeploy.model_executor.layers.sampler import (
    LogprobsArrays,
    Sampler,
    SamplingMetadata,
    gather_logprobs,
    log_softmax,
)
from fastdeploy.model_executor.model_loader import get_model
from fastdeploy.worker.input_batch import CachedRequestState, InputBatch
from fastdeploy.worker.model_runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

logger = init_logger(__name__)

_SAMPLING_EPS = 1e-5
_UINT64_MASK = (1 << 64) - 1
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _to_lists(arrays: LogprobsArrays, rows: slice = slice(None), width: int | None = None) -> LogprobsLists:
    """Plain lists of ``rows`` of the arrays, keeping the chosen token and the first ``width - 1`` top tokens."""
    return LogprobsLists(arrays.token_ids[rows, :width].tolist(), arrays.logprobs[rows, :width].tolist(),
                         arrays.ranks[rows].tolist())


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
        self.sampler = Sampler()
        self.model = None
        self.kv_caches: list[tuple[paddle.Tensor, paddle.Tensor]] = []
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, -(-self.max_model_len // self.block_size))
        self._seed = mc.seed

    # ---- set-up ------------------------------------------------------------------------
    def load_model(self) -> None:
        if self._seed is not None:
            paddle.seed(self._seed)
        self.model = get_model(self.model_config, self.fd_config.load_config)
        self.model.eval()

    @property
    def kv_cache_dtype(self) -> str:
        """The model's choice (bf16 for a bf16 model on the C++ kernels), float32 before loading."""
        return getattr(self.model, "kv_cache_dtype", None) or "float32"

    def kv_cache_bytes_per_block(self) -> int:
        mc = self.model_config
        itemsize = _DTYPE_BYTES[self.kv_cache_dtype]
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate K and V per layer as ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        ``paddle.empty`` leaves pages untouched until written, so a large
        budget costs memory only as it fills.
        """
        mc = self.model_config
        shape = [num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim]
        dtype = self.kv_cache_dtype
        self.kv_caches = [
            (paddle.empty(shape, dtype=dtype), paddle.empty(shape, dtype=dtype)) for _ in range(mc.num_layers)
        ]

    # ---- batch state -------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
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
            state.output_token_ids = list(new.token_ids[new.num_prompt_tokens :])
            batch.add_request(
                new.req_id,
                new.token_ids,
                new.num_prompt_tokens,
                new.num_computed_tokens,
                new.block_ids,
                new.sampling_params,
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

        # Decodes (one token) first, then prefill chunks.
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1)
        rows = np.fromiter((batch.req_id_to_index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        n = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        computed = batch.num_computed_tokens[rows]
        cu_end = np.cumsum(n)
        starts = cu_end - n
        seq_lens = computed + n
        # Only the block-table columns this step reaches travel to the kernels.
        block_tables = batch.block_table[rows, : -(-int(seq_lens.max()) // bs)]
        meta, positions = build_attention_metadata(block_tables, n, seq_lens, bs)
        input_ids = batch.token_ids[np.repeat(rows, n), positions]

        hidden = self.model(paddle.to_tensor(input_ids), paddle.to_tensor(positions), self.kv_caches, meta)

        # Requests whose chunk reaches their last known token sample the next one.
        sample_mask = computed + n >= batch.num_tokens[rows]
        out = ModelRunnerOutput()
        self._prompt_logprobs(req_ids, rows, computed, n, starts, hidden, out)
        if not sample_mask.any():
            return out
        s_idx = np.nonzero(sample_mask)[0]
        s_req_ids = [req_ids[i] for i in s_idx]
        s_rows = rows[s_idx]
        last_rows = cu_end[s_idx] - 1
        # A decode-only step samples every row in order: no gather needed.
        if len(last_rows) != len(hidden) or last_rows[-1] != len(last_rows) - 1:
            hidden = paddle.gather(hidden, paddle.to_tensor(last_rows))
        logits = self.model.compute_logits(hidden).numpy()
        md = self._sampling_metadata(s_req_ids, s_rows)
        # Structured outputs: the scheduler's grammar bitmask, reordered to this step's sampled rows.
        md.grammar_bitmask, md.grammar_rows = so.grammar_rows(s_req_ids)
        result = self.sampler(logits, md)
        sampled = result.sampled_token_ids
        pos = batch.num_tokens[s_rows]
        fits = pos < self.max_model_len
        batch.token_ids[s_rows[fits], pos[fits]] = sampled[fits]
        batch.num_tokens[s_rows] = pos + 1
        for req_id, tok in zip(s_req_ids, sampled.tolist(), strict=True):
            self.requests[req_id].output_token_ids.append(tok)
            out.sampled_token_ids[req_id] = [tok]
        if result.logprobs is not None:
            lp = result.logprobs
            for j, req_id in enumerate(s_req_ids):
                k = self.requests[req_id].sampling_params.logprobs
                if k is None:
                    continue
                width = lp.token_ids.shape[1] if k == -1 else min(k, self.vocab_size) + 1
                out.logprobs[req_id] = _to_lists(lp, slice(j, j + 1), width)
        return out

    def _sampling_metadata(self, req_ids: list[str], rows: np.ndarray) -> SamplingMetadata:
        b = self.input_batch
        temperature = b.temperature[rows]
        md = SamplingMetadata(temperature=temperature, all_greedy=bool((temperature < _SAMPLING_EPS).all()))
        if not md.all_greedy:
            if (b.top_p[rows] < 1.0).any():
                md.top_p = b.top_p[rows]
            if (b.top_k[rows] > 0).any():
                md.top_k = b.top_k[rows]
            if (b.min_p[rows] > 0).any():
                md.min_p = b.min_p[rows]
        penalized = (
            (b.repetition_penalty[rows] != 1.0) | (b.presence_penalty[rows] != 0) | (b.frequency_penalty[rows] != 0)
        )
        states = [self.requests[r] for r in req_ids]
        if penalized.any():
            md.repetition_penalties = b.repetition_penalty[rows]
            md.presence_penalties = b.presence_penalty[rows]
            md.frequency_penalties = b.frequency_penalty[rows]
            md.prompt_token_ids = [b.token_ids[row, : b.num_prompt_tokens[row]] for row in rows]
        max_lp: int | None = None
        for j, st in enumerate(states):
            sp = st.sampling_params
            if st.generator is not None and sp.temperature >= _SAMPLING_EPS:
                md.generators[j] = st.generator
            if sp.logprobs is not None:
                max_lp = -1 if sp.logprobs == -1 or max_lp == -1 else max(max_lp or 0, sp.logprobs)
            if sp.logit_bias:
                md.logit_bias[j] = sp.logit_bias
            if sp.allowed_token_ids:
                md.allowed_token_ids[j] = list(sp.allowed_token_ids)
            if st.bad_words_token_ids:
                md.bad_words_token_ids[j] = st.bad_words_token_ids
            if sp.min_tokens and len(st.output_token_ids) < sp.min_tokens:
                # vLLM masks every stop id and EOS here, even with ignore_eos.
                stop_ids = set(sp.all_stop_token_ids) | set(sp.stop_token_ids or ())
                if st.eos_token_id is not None:
                    stop_ids.add(st.eos_token_id)
                if stop_ids:
                    md.min_tokens_block[j] = sorted(stop_ids)
        if penalized.any() or md.bad_words_token_ids:
            md.output_token_ids = [st.output_token_ids for st in states]
        md.max_num_logprobs = max_lp
        return md

    def _prompt_logprobs(self, req_ids, rows, computed, n, starts, hidden, out: ModelRunnerOutput) -> None:
        """Logprobs of the prompt tokens this chunk predicts (token i+1 from position i)."""
        batch = self.input_batch
        for i, req_id in enumerate(req_ids):
            k = self.requests[req_id].sampling_params.prompt_logprobs
            if k is None:
                continue
            row = rows[i]
            first, end = int(computed[i]), min(int(computed[i] + n[i]), int(batch.num_prompt_tokens[row]) - 1)
            if end <= first:
                continue
            idx = np.arange(int(starts[i]), int(starts[i]) + end - first)
            logits = self.model.compute_logits(paddle.gather(hidden, paddle.to_tensor(idx))).numpy()
            targets = batch.token_ids[row, first + 1 : end + 1]
            out.prompt_logprobs[req_id] = _to_lists(gather_logprobs(log_softmax(logits), targets, k))
