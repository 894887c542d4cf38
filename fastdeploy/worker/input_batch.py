"""The persistent batch: one row per running request, kept across steps in numpy buffers.

Rows hold token ids, progress, the block table and every sampling setting, written
once when a request joins, so building a step's inputs and its
:class:`SamplingMetadata` is fancy indexing over these buffers rather than
rebuilding per-request Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.model_executor.layers.sampler import SamplingMetadata, seen_token_counts
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.spec_decode.spec_batch import output_rows

_SAMPLING_EPS = 1e-5


@dataclass
class CachedRequestState:
    """What the runner keeps per request besides its row (survives preemption)."""

    req_id: str
    sampling_params: SamplingParams
    num_prompt_tokens: int
    eos_token_id: int | None
    generator: np.random.Generator | None
    bad_words_token_ids: list[list[int]] | None = None


class RowTokenTable:
    """Token ids (optionally with one value each) per batch row, kept flattened for vectorized lookups.

    Rows change only when requests join or leave; the flat arrays are rebuilt at the next lookup
    after such a change, never per step.
    """

    def __init__(self) -> None:
        self._rows: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        self._flat: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None

    def __bool__(self) -> bool:
        return bool(self._rows)

    def set(self, row: int, ids: np.ndarray, values: np.ndarray | None = None) -> None:
        """Give ``row`` these token ids (and values)."""
        self._rows[row] = (np.asarray(ids, dtype=np.int64), values)
        self._flat = None

    def remove(self, row: int) -> None:
        """Forget ``row`` (no-op when it has no entries)."""
        if self._rows.pop(row, None) is not None:
            self._flat = None

    def lookup(self, pos_of_row: np.ndarray, num_pos: np.ndarray | None = None,
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None] | None:
        """Entries of the rows with ``pos_of_row[row] >= 0`` as ``(positions, ids, values)``; None if none.

        With ``num_pos`` (per batch row) a row's entries appear at each of its positions
        ``pos_of_row[row] .. pos_of_row[row] + num_pos[row] - 1`` (speculative decoding's verified
        positions), grouped by position, in table order within one.
        """
        if not self._rows:
            return None
        if self._flat is None:
            owners = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, (ids, _) in self._rows.items()])
            ids = np.concatenate([ids for ids, _ in self._rows.values()])
            has_values = next(iter(self._rows.values()))[1] is not None
            values = np.concatenate([v for _, v in self._rows.values()]) if has_values else None
            self._flat = (owners, ids, values)
        owners, ids, values = self._flat
        pos = pos_of_row[owners]
        keep = pos >= 0
        if not keep.any():
            return None
        if num_pos is None:
            return pos[keep], ids[keep], None if values is None else values[keep]
        keep = np.flatnonzero(keep)
        pos, entry = spread_over_positions(pos[keep], num_pos[owners[keep]])
        return pos, ids[keep[entry]], None if values is None else values[keep[entry]]


def spread_over_positions(first: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entry i repeated at positions ``first[i] .. first[i] + counts[i] - 1``.

    Returns ``(positions, entry index)`` sorted by position; entries keep their order within a
    position (a row's ``logprob_token_ids`` are in the order asked).
    """
    pos = output_rows(first, counts)
    entry = np.repeat(np.arange(len(first)), counts)
    order = np.argsort(pos, kind="stable")
    return pos[order], entry[order]


class InputBatch:
    """Fixed-capacity row storage for up to ``max_num_reqs`` requests."""

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int64)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.has_penalty = np.zeros(max_num_reqs, dtype=bool)
        # Top logprobs per sampled / prompt token: -1 = none, vocab_size = the whole vocabulary.
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.generators: dict[int, np.random.Generator] = {}
        self.logit_bias = RowTokenTable()
        self.allowed_token_ids = RowTokenTable()
        self.logprob_token_ids = RowTokenTable()
        self.min_tokens_stop_ids = RowTokenTable()
        self.bad_words = BadWordsTable()
        # Penalties: seen_counts[row, token] is 0 for a token the row has not seen, else 1 + how often
        # the row generated it (so a prompt token reads 1); seen_ids[row, :num_seen[row]] lists the
        # seen tokens, so a step touches those only. np.zeros leaves untouched pages unallocated.
        self.seen_counts = np.zeros((max_num_reqs, vocab_size), dtype=np.int32)
        self.seen_ids = np.zeros((max_num_reqs, 64), dtype=np.int64)
        self.num_seen = np.zeros(max_num_reqs, dtype=np.int64)
        self.req_id_to_index: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.req_id_to_index)

    def add_request(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        num_computed: int,
        block_ids: list[int],
        sp: SamplingParams,
        *,
        eos_token_id: int | None = None,
        generator: np.random.Generator | None = None,
        bad_words_token_ids: list[list[int]] | None = None,
    ) -> int:
        """Put a request (new, or resuming after preemption with its outputs in ``token_ids``) in a row."""
        if not self._free_rows:
            raise RuntimeError(f"The persistent batch is full ({self.max_num_reqs} requests).")
        row = self._free_rows.pop()
        self.req_id_to_index[req_id] = row
        n = len(token_ids)
        self.token_ids[row, :n] = token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = num_prompt_tokens
        self.num_computed_tokens[row] = num_computed
        self.num_blocks[row] = 0
        self.append_block_ids(row, block_ids)
        self.temperature[row] = sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k if sp.top_k and sp.top_k > 0 else 0
        self.min_p[row] = sp.min_p
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.repetition_penalty[row] = sp.repetition_penalty
        self.has_penalty[row] = sp.repetition_penalty != 1.0 or sp.presence_penalty != 0 or sp.frequency_penalty != 0
        if self.has_penalty[row]:
            ids, counts = seen_token_counts(self.token_ids[row, :num_prompt_tokens], self.token_ids[row, num_prompt_tokens:n])
            self._grow_seen(len(ids))
            self.seen_counts[row, ids] = counts + 1
            self.seen_ids[row, : len(ids)] = ids
            self.num_seen[row] = len(ids)
        self.num_logprobs[row] = self._num_logprobs(sp.num_logprobs)
        if sp.logprob_token_ids:
            self.logprob_token_ids.set(row, np.asarray(sp.logprob_token_ids, dtype=np.int64))
        self.num_prompt_logprobs[row] = self._num_logprobs(sp.prompt_logprobs)
        if generator is not None:
            self.generators[row] = generator
        if sp.logit_bias:
            self.logit_bias.set(
                row,
                np.fromiter(sp.logit_bias.keys(), dtype=np.int64, count=len(sp.logit_bias)),
                np.fromiter(sp.logit_bias.values(), dtype=np.float32, count=len(sp.logit_bias)),
            )
        if sp.allowed_token_ids:
            self.allowed_token_ids.set(row, np.asarray(list(sp.allowed_token_ids), dtype=np.int64))
        self.min_tokens[row] = sp.min_tokens or 0
        if sp.min_tokens:
            # vLLM masks every stop id and EOS here, even with ignore_eos.
            stop_ids = set(sp.all_stop_token_ids) | set(sp.stop_token_ids or ())
            if eos_token_id is not None:
                stop_ids.add(eos_token_id)
            if stop_ids:
                self.min_tokens_stop_ids.set(row, np.array(sorted(stop_ids), dtype=np.int64))
        if bad_words_token_ids:
            self.bad_words.set(row, bad_words_token_ids)
        return row

    def _num_logprobs(self, k: int | None) -> int:
        return -1 if k is None else (self.vocab_size if k == -1 else k)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        """Extend ``row``'s block table."""
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, req_id: str) -> None:
        """Free the request's row and forget its sampling settings."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        if self.has_penalty[row]:
            # Leave the count row all zero for the next request, touching only what was written.
            self.seen_counts[row, self.seen_ids[row, : self.num_seen[row]]] = 0
            self.num_seen[row] = 0
            self.has_penalty[row] = False
        self.generators.pop(row, None)
        for table in (self.logit_bias, self.allowed_token_ids, self.logprob_token_ids, self.min_tokens_stop_ids,
                      self.bad_words):
            table.remove(row)
        self._free_rows.append(row)

    def _grow_seen(self, needed: int) -> None:
        width = self.seen_ids.shape[1]
        if needed > width:
            grown = np.zeros((self.max_num_reqs, max(needed, 2 * width)), dtype=np.int64)
            grown[:, :width] = self.seen_ids
            self.seen_ids = grown

    def append_sampled(self, rows: np.ndarray, tokens: np.ndarray) -> None:
        """Record one sampled token per row (rows distinct): O(batch)."""
        pos = self.num_tokens[rows]
        fits = pos < self.max_model_len
        self.token_ids[rows[fits], pos[fits]] = tokens[fits]
        self.num_tokens[rows] = pos + 1
        pen = self.has_penalty[rows]
        if pen.any():
            rows, tokens = rows[pen], tokens[pen]
            new = self.seen_counts[rows, tokens] == 0
            if new.any():
                self._grow_seen(int(self.num_seen[rows[new]].max()) + 1)
                self.seen_ids[rows[new], self.num_seen[rows[new]]] = tokens[new]
                self.num_seen[rows[new]] += 1
            self.seen_counts[rows, tokens] += 1 + new

    def make_sampling_metadata(self, rows: np.ndarray, num_pos: np.ndarray | None = None) -> SamplingMetadata:
        """The settings of ``rows`` (batch rows, in sampling order) for one sampler call: O(batch) numpy.

        ``num_pos`` (speculative decoding): request i samples ``num_pos[i]`` consecutive rows, one per
        verified position ``[last token, d_1 .. d_k]`` (the drafts written after its known tokens).
        Position j is sampled as the request would be with d_1..d_j accepted: they count as outputs
        for the penalties, for ``min_tokens`` and for the bad words' prefixes, so each position's
        distribution is the one plain decoding would sample from there.
        """
        if num_pos is not None and (num_pos == 1).all():
            num_pos = None
        pos_of_row = np.full(self.max_num_reqs, -1, dtype=np.int64)
        if num_pos is None:
            pos_rows, num_pos_of_row, drafts_before = rows, None, None
            pos_of_row[rows] = np.arange(len(rows))
        else:
            first = np.cumsum(num_pos) - num_pos
            pos_rows = np.repeat(rows, num_pos)
            pos_of_row[rows] = first
            num_pos_of_row = np.zeros(self.max_num_reqs, dtype=np.int64)
            num_pos_of_row[rows] = num_pos
            drafts_before = np.arange(len(pos_rows)) - np.repeat(first, num_pos)
        temperature = self.temperature[pos_rows]
        greedy = temperature < _SAMPLING_EPS
        md = SamplingMetadata(temperature=temperature, all_greedy=bool(greedy.all()))
        if not md.all_greedy:
            if (self.top_p[rows] < 1.0).any():
                md.top_p = self.top_p[pos_rows]
            if (self.top_k[rows] > 0).any():
                md.top_k = self.top_k[pos_rows]
            if (self.min_p[rows] > 0).any():
                md.min_p = self.min_p[pos_rows]
        if self.generators and not md.all_greedy:
            # A request's generator serves each of its positions, in position order.
            md.generators = {
                int(pos_of_row[row]) + j: gen
                for row, gen in self.generators.items()
                if pos_of_row[row] >= 0 and not greedy[pos_of_row[row]]
                for j in range(1 if num_pos_of_row is None else int(num_pos_of_row[row]))
            }
        max_lp = int(self.num_logprobs[rows].max())
        md.max_num_logprobs = max_lp if max_lp >= 0 else None
        if self.logprob_token_ids:
            found = self.logprob_token_ids.lookup(pos_of_row, num_pos_of_row)
            md.logprob_token_ids = None if found is None else found[:2]
        pen = self.has_penalty[pos_rows]
        if pen.any():
            md.repetition_penalties = self.repetition_penalty[pos_rows]
            md.presence_penalties = self.presence_penalty[pos_rows]
            md.frequency_penalties = self.frequency_penalty[pos_rows]
            pen_pos = np.flatnonzero(pen)
            pen_rows = pos_rows[pen_pos]
            num_seen = self.num_seen[pen_rows]
            width = int(num_seen.max())
            ids = self.seen_ids[pen_rows, :width][np.arange(width) < num_seen[:, None]]
            owners = np.repeat(pen_rows, num_seen)
            md.penalty_token_rows = np.repeat(pen_pos, num_seen)
            md.penalty_token_ids = ids
            md.output_token_counts = self.seen_counts[owners, ids] - 1
            if drafts_before is not None and drafts_before[pen_pos].any():
                self._count_drafts(md, pen_pos, pen_rows, drafts_before[pen_pos])
        if self.logit_bias:
            md.logit_bias = self.logit_bias.lookup(pos_of_row, num_pos_of_row)
        if self.allowed_token_ids:
            found = self.allowed_token_ids.lookup(pos_of_row, num_pos_of_row)
            md.allowed_token_ids = None if found is None else found[:2]
        blocked = []
        if self.min_tokens_stop_ids:
            num_outputs = self.num_tokens[pos_rows] - self.num_prompt_tokens[pos_rows]
            if drafts_before is not None:
                num_outputs = num_outputs + drafts_before
            under = self.min_tokens[pos_rows] > num_outputs
            if under.any():
                pos_under = pos_of_row.copy()
                pos_under[rows[~under[pos_of_row[rows]]]] = -1  # a row over min_tokens at its first position is over at all
                found = self.min_tokens_stop_ids.lookup(pos_under, num_pos_of_row)
                if found is not None:
                    keep = under[found[0]]
                    blocked.append((found[0][keep], found[1][keep]))
        if self.bad_words:
            found = self.bad_words.blocked(pos_of_row, self.token_ids, self.num_tokens, self.num_prompt_tokens,
                                           num_pos_of_row)
            if found is not None:
                blocked.append(found)
        if blocked:
            md.blocked_token_ids = (np.concatenate([b[0] for b in blocked]), np.concatenate([b[1] for b in blocked]))
        return md

    def _count_drafts(self, md: SamplingMetadata, pen_pos: np.ndarray, pen_rows: np.ndarray,
                      drafts_before: np.ndarray) -> None:
        """Merge the drafts before each penalised position into its (position, token, output count) table.

        The drafts sit at ``token_ids[row, num_tokens:]``; once accepted they are outputs, so position
        j counts d_1..d_j. Entries stay unique per (position, token), as the penalties' scatter needs.
        """
        d_pos = np.repeat(pen_pos, drafts_before)
        d_ids = self.token_ids[np.repeat(pen_rows, drafts_before), output_rows(self.num_tokens[pen_rows], drafts_before)]
        v = self.vocab_size
        keys, inverse = np.unique(np.concatenate([md.penalty_token_rows * v + md.penalty_token_ids, d_pos * v + d_ids]),
                                  return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([md.output_token_counts, np.ones(len(d_ids))]))
        md.penalty_token_rows, md.penalty_token_ids = np.divmod(keys, v)
        md.output_token_counts = counts.astype(np.int32)


class BadWordsTable:
    """Every row's bad words, as right-aligned prefix arrays, to match all of them against the outputs at once."""

    def __init__(self) -> None:
        self._rows: dict[int, list[list[int]]] = {}
        self._flat: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def __bool__(self) -> bool:
        return bool(self._rows)

    def set(self, row: int, words: list[list[int]]) -> None:
        """Give ``row`` these bad words (token id sequences)."""
        self._rows[row] = [list(w) for w in words if w]
        self._flat = None

    def remove(self, row: int) -> None:
        """Forget ``row``'s bad words."""
        if self._rows.pop(row, None) is not None:
            self._flat = None

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        words = [(row, w) for row, ws in self._rows.items() for w in ws]
        width = max(len(w) - 1 for _, w in words)
        prefix = np.full((len(words), width), -1, dtype=np.int64)
        for i, (_, w) in enumerate(words):
            if len(w) > 1:
                prefix[i, width - len(w) + 1 :] = w[:-1]
        owners = np.array([row for row, _ in words], dtype=np.int64)
        prefix_len = np.array([len(w) - 1 for _, w in words], dtype=np.int64)
        last = np.array([w[-1] for _, w in words], dtype=np.int64)
        return owners, prefix, prefix_len, last

    def blocked(
        self, pos_of_row: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray, num_prompt_tokens: np.ndarray,
        num_pos: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """``(positions, token ids)`` to block: each word's last token where the output ends with its prefix.

        With ``num_pos`` (per batch row) the row's j-th position reads its output as extended by the
        j tokens after ``num_tokens`` (the drafts before that position).
        """
        if self._flat is None:
            self._flat = self._build()
        owners, prefix, prefix_len, last = self._flat
        pos = pos_of_row[owners]
        sel = np.flatnonzero(pos >= 0)
        ends = num_tokens[owners[sel]]
        if num_pos is not None:
            pos, entry = spread_over_positions(pos[sel], num_pos[owners[sel]])
            ends = ends[entry] + pos - pos_of_row[owners[sel[entry]]]
            sel = sel[entry]
        else:
            pos = pos[sel]
        owners, prefix, prefix_len, last = owners[sel], prefix[sel], prefix_len[sel], last[sel]
        width = prefix.shape[1]
        # The last `width` tokens before each position; only a word's own prefix length of them counts.
        cols = ends[:, None] - width + np.arange(width)
        tail = token_ids[owners[:, None], np.clip(cols, 0, token_ids.shape[1] - 1)]
        counted = np.arange(width) >= width - prefix_len[:, None]
        match = ((tail == prefix) | ~counted).all(axis=-1)
        match &= prefix_len <= ends - num_prompt_tokens[owners]
        if not match.any():
            return None
        return pos[match], last[match]
