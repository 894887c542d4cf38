"""Token sampling for a whole batch at once.

The order follows vLLM: logprobs are taken from the raw logits (after the
grammar bitmask); then allowed tokens, blocked tokens (bad words, stop tokens
under min_tokens), logit bias and penalties shape the logits; greedy rows take
the argmax; random rows apply temperature, min_p, top-k and top-p and draw by
inverse CDF with one uniform per row, taken from the request's own generator
when it is seeded, so a seeded request samples the same tokens whatever else
is in the batch.

Every step is a batched numpy operation over the rows: the per-request
settings arrive as flat ``(rows, token ids[, values])`` arrays built by the
persistent :class:`~fastdeploy.worker.input_batch.InputBatch`, penalties touch
only the (row, token) pairs a row has seen, and top-k / top-p work on a few
hundred candidates per row found by a threshold rather than on a sort of the
whole vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fastdeploy import _custom_ops as ops

_SAMPLING_EPS = 1e-5
# Top-p without top-k first looks at about this many best tokens; only when they hold less than
# top_p of the mass does it cut the whole row (float32 rows by a histogram of their values, not a sort).
_TOP_P_CANDIDATES = 1024
# A top-p row with more candidates than this is cut by a histogram of its values instead of a sort.
_HISTOGRAM_FROM = 4 * _TOP_P_CANDIDATES
# The candidate threshold comes from every _STRIDE-th token of a row: the j-th largest of that
# sample has about _STRIDE * j tokens above it in the row, so the threshold costs 1/_STRIDE of a
# full selection. A row whose threshold keeps too few tokens is redone exactly.
_STRIDE = 16
_STRIDE_MARGIN = 8
# Inverse-CDF sampling first picks a block of this many tokens, then the token inside it, so a
# row costs one pass (the block sums) instead of a full-vocabulary cumulative sum.
_CDF_BLOCK = 256
_SMALLEST_POSITIVE = np.nextafter(np.float32(0), np.float32(1))


@dataclass
class SamplingMetadata:
    """Sampling settings of the rows sampled this step (row = one request), as batched arrays.

    Sparse per-row settings come flattened: ``rows[i]`` is the batch row of entry ``i``.
    """

    temperature: np.ndarray  # [S] float32; < eps means greedy
    all_greedy: bool
    top_p: np.ndarray | None = None  # [S] float32, 1.0 = off
    top_k: np.ndarray | None = None  # [S] int64, 0 = off
    min_p: np.ndarray | None = None  # [S] float32, 0 = off
    # Row -> the request's own generator (seeded requests only).
    generators: dict[int, np.random.Generator] = field(default_factory=dict)
    # None: no logprobs this step; -1 or >= vocab: the whole vocabulary.
    max_num_logprobs: int | None = None
    # (rows, token ids), grouped by row in the order asked: rows returning the logprobs of these
    # ids (vLLM's logprob_token_ids) instead of their top-k.
    logprob_token_ids: tuple[np.ndarray, np.ndarray] | None = None
    # Penalties [S] (None: no row is penalised) and, for the penalised rows, every (row, token)
    # pair the row has seen in its prompt or output with how often it generated it (0 = prompt only).
    presence_penalties: np.ndarray | None = None
    frequency_penalties: np.ndarray | None = None
    repetition_penalties: np.ndarray | None = None
    penalty_token_rows: np.ndarray | None = None  # [N] int64
    penalty_token_ids: np.ndarray | None = None  # [N] int64
    output_token_counts: np.ndarray | None = None  # [N] int32
    # (rows, token ids, bias) added to the logits.
    logit_bias: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # (rows, token ids): only these tokens may be sampled in those rows.
    allowed_token_ids: tuple[np.ndarray, np.ndarray] | None = None
    # (rows, token ids) that may not be sampled this step: bad words whose prefix the output ends
    # with, and stop tokens while a request has fewer than min_tokens outputs.
    blocked_token_ids: tuple[np.ndarray, np.ndarray] | None = None
    # Structured outputs: allowed-token bitmask rows [m, ceil(vocab / 32)] int32 (xgrammar's
    # layout, bit i of word j = token 32 * j + i) and the sampled row each one applies to.
    grammar_bitmask: np.ndarray | None = None
    grammar_rows: np.ndarray | None = None


@dataclass
class LogprobsArrays:
    """Chosen token first, then the top-k (or the ids the row asked for), per row."""

    token_ids: np.ndarray  # [S, k + 1] int64
    logprobs: np.ndarray  # [S, k + 1] float32
    ranks: np.ndarray  # [S] int64, rank of the chosen token (1 = best)
    # [S, k + 1] int64, the rank of every entry: only when some row asked for specific ids (the
    # top-k of the other rows rank 1..k by position, which is what a missing table means).
    entry_ranks: np.ndarray | None = None

    def take(self, rows: np.ndarray) -> LogprobsArrays:
        """These rows only."""
        return LogprobsArrays(self.token_ids[rows], self.logprobs[rows], self.ranks[rows],
                              None if self.entry_ranks is None else self.entry_ranks[rows])


@dataclass
class SamplerOutput:
    """The sampled token of each row and, when asked for, their logprobs."""

    sampled_token_ids: np.ndarray  # [S] int64
    logprobs: LogprobsArrays | None


def log_softmax(logits: np.ndarray, out: np.ndarray | None = None, scratch: np.ndarray | None = None) -> np.ndarray:
    """Row-wise log-softmax of ``[S, V]`` logits, into ``out`` (a new array when None).

    ``scratch`` (the shape of ``out``) holds the exponentials; the values are the same either way.
    """
    out = np.subtract(logits, logits.max(axis=-1, keepdims=True), out=out)
    out -= np.log(np.exp(out, out=scratch).sum(axis=-1, keepdims=True))
    return out


# Rows of prompt logits turned into logprobs at a time: two [S, V] temporaries for a 600-token
# prompt are 240 MB of fresh pages (page faults, then cache misses on every pass); a chunk's stay
# in the cache (16 rows of a 49k vocabulary: 3 MB). Measured 0.078 -> 0.048 s for 600 rows.
_LOGPROBS_CHUNK_ROWS = 16


def logprobs_of_rows(logits: np.ndarray, token_ids: np.ndarray, num_logprobs: int) -> LogprobsArrays:
    """``gather_logprobs(log_softmax(logits), token_ids, num_logprobs)`` a chunk of rows at a time.

    The same values, without the ``[S, V]`` temporaries; ``logits`` may be a read-only view.
    """
    num_rows, vocab = logits.shape
    width = (vocab if num_logprobs == -1 else min(num_logprobs, vocab)) + 1
    out = LogprobsArrays(np.empty((num_rows, width), np.int64), np.empty((num_rows, width), np.float32),
                         np.empty(num_rows, np.int64))
    rows = min(_LOGPROBS_CHUNK_ROWS, num_rows)
    buf, scratch = np.empty((rows, vocab), np.float32), np.empty((rows, vocab), np.float32)
    for a in range(0, num_rows, rows):
        b = min(a + rows, num_rows)
        part = gather_logprobs(log_softmax(logits[a:b], buf[: b - a], scratch[: b - a]), token_ids[a:b],
                               num_logprobs)
        out.token_ids[a:b], out.logprobs[a:b], out.ranks[a:b] = part.token_ids, part.logprobs, part.ranks
    return out


def gather_logprobs(logprobs: np.ndarray, token_ids: np.ndarray, num_logprobs: int) -> LogprobsArrays:
    """The chosen tokens' logprobs and ranks plus the top ``num_logprobs`` (-1 = all) of each row."""
    rows = np.arange(logprobs.shape[0])
    chosen = logprobs[rows, token_ids]
    ranks = (logprobs > chosen[:, None]).sum(axis=-1) + 1
    k = logprobs.shape[-1] if num_logprobs == -1 else min(num_logprobs, logprobs.shape[-1])
    if k == 1 and logprobs.shape[-1] > 1:
        # lm-eval's loglikelihood asks for the top 1 of every prompt token: argmax is ~100x
        # faster than argpartition over a 49k vocabulary (0.01 s vs 0.6 s for 600 rows here).
        top = logprobs.argmax(axis=-1)[:, None]
        ids = np.concatenate([token_ids[:, None], top], axis=-1)
        lps = np.concatenate([chosen[:, None], np.take_along_axis(logprobs, top, axis=-1)], axis=-1)
    elif k > 0:
        top = (
            np.argpartition(-logprobs, k - 1, axis=-1)[:, :k]
            if k < logprobs.shape[-1]
            else np.tile(np.arange(k), (len(rows), 1))
        )
        top_lp = np.take_along_axis(logprobs, top, axis=-1)
        order = np.argsort(-top_lp, axis=-1, kind="stable")
        top = np.take_along_axis(top, order, axis=-1)
        top_lp = np.take_along_axis(top_lp, order, axis=-1)
        ids = np.concatenate([token_ids[:, None], top], axis=-1)
        lps = np.concatenate([chosen[:, None], top_lp], axis=-1)
    else:
        ids, lps = token_ids[:, None], chosen[:, None]
    return LogprobsArrays(ids.astype(np.int64), lps.astype(np.float32), ranks.astype(np.int64))


def requested_logprobs(logprobs: np.ndarray, arrays: LogprobsArrays, rows: np.ndarray,
                       token_ids: np.ndarray) -> LogprobsArrays:
    """``arrays`` with the entries after the chosen token of ``rows`` replaced by ``token_ids``
    (grouped by row, in the order asked) and their logprobs, every entry carrying its rank.

    The rows' widths (their ``num_logprobs``) are their id counts, so the ids fit the top-k columns.
    """
    starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    cols = 1 + np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
    values = logprobs[rows, token_ids]
    entry_ranks = np.tile(np.arange(arrays.token_ids.shape[1], dtype=np.int64), (len(arrays.ranks), 1))
    entry_ranks[:, 0] = arrays.ranks
    entry_ranks[rows, cols] = (logprobs[rows] > values[:, None]).sum(axis=-1) + 1
    arrays.token_ids[rows, cols] = token_ids
    arrays.logprobs[rows, cols] = values
    arrays.entry_ranks = entry_ranks
    return arrays


class Sampler:
    """Samples one token per row from ``[S, vocab]`` fp32 logits.

    Args:
        kernels: run the two full-vocabulary passes of random sampling (temperature + exp, the
            inverse-CDF draw) in csrc/cpu/sampling.cc instead of numpy; the platform's choice
            (``OpBackend.sampler``).
    """

    def __init__(self, kernels: bool = False) -> None:
        self._rng = np.random.default_rng()
        self.kernels = kernels

    def __call__(self, logits: np.ndarray, md: SamplingMetadata, *, inplace: bool = False) -> SamplerOutput:
        """Sample every row; ``inplace=True`` lets the sampler use ``logits`` as its scratch buffer."""
        if not inplace:
            logits = logits.copy()
        if md.grammar_bitmask is not None:
            # Before the logprobs, as in vLLM: a constrained request's logprobs are those of the
            # distribution it actually samples from.
            apply_token_bitmask(logits, md.grammar_bitmask, md.grammar_rows)
        raw_logprobs = log_softmax(logits) if md.max_num_logprobs is not None else None
        self.apply_logits_processors(logits, md)
        if md.all_greedy:
            sampled = logits.argmax(axis=-1)
        else:
            random_rows = np.flatnonzero(md.temperature >= _SAMPLING_EPS)
            sampled = (
                np.empty(len(logits), dtype=np.int64)
                if len(random_rows) == len(logits)
                else logits.argmax(axis=-1)  # greedy rows, before the random path reuses the buffer
            )
            sampled[random_rows] = self.sample_random(logits, md, random_rows)
        sampled = sampled.astype(np.int64, copy=False)
        lp = None if raw_logprobs is None else gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        if lp is not None and md.logprob_token_ids is not None:
            lp = requested_logprobs(raw_logprobs, lp, *md.logprob_token_ids)
        return SamplerOutput(sampled, lp)

    @staticmethod
    def apply_logits_processors(logits: np.ndarray, md: SamplingMetadata) -> np.ndarray:
        """Allowed tokens, blocked tokens, logit bias and penalties, in place; returns ``logits``."""
        if md.allowed_token_ids is not None:
            rows, ids = md.allowed_token_ids
            keep = logits[rows, ids]
            logits[np.unique(rows)] = -np.inf
            logits[rows, ids] = keep
        if md.blocked_token_ids is not None:
            rows, ids = md.blocked_token_ids
            logits[rows, ids] = -np.inf
        if md.logit_bias is not None:
            rows, ids, bias = md.logit_bias
            logits[rows, ids] += bias  # ids are unique within a row, so no update is lost
        if md.repetition_penalties is not None:
            apply_penalties(logits, md)
        return logits

    def sample_random(self, logits: np.ndarray, md: SamplingMetadata, rows: np.ndarray) -> np.ndarray:
        """Tokens for ``rows`` (the random rows, ascending), reusing ``logits`` as scratch space."""
        probs = logits if len(rows) == len(logits) else logits[rows]
        inv_temperature = (1.0 / md.temperature[rows]).astype(np.float32)
        uniform = self._rng.random(len(rows))
        for pos, gen in md.generators.items():
            local = np.searchsorted(rows, pos)
            if local < len(rows) and rows[local] == pos:
                uniform[local] = gen.random()
        truncated = md.min_p is not None or md.top_k is not None or md.top_p is not None
        if self.kernels and not truncated:  # the whole vocabulary: exp and draw in one call
            return ops.sample_random(np.ascontiguousarray(probs), inv_temperature, uniform)
        # Unnormalised probabilities exp((l - max) / t): the row maximum is 1, which makes min_p a
        # plain threshold, and nothing downstream needs them normalised.
        if self.kernels:
            probs = np.ascontiguousarray(probs)
            ops.exp_scaled(probs, inv_temperature)
        else:
            probs -= probs.max(axis=-1, keepdims=True)
            probs *= inv_temperature[:, None]
            np.exp(probs, out=probs)
        if md.min_p is not None:
            np.putmask(probs, probs < md.min_p[rows, None], 0.0)
        out = np.empty(len(rows), dtype=np.int64)
        full = np.ones(len(rows), dtype=bool)
        if md.top_k is not None or md.top_p is not None:
            top_k = None if md.top_k is None else md.top_k[rows]
            top_p = None if md.top_p is None else md.top_p[rows]
            trunc, cand_ids, cand_probs = top_k_top_p_candidates(probs, top_k, top_p)
            if len(trunc):
                picked = inverse_cdf_sample(cand_probs, uniform[trunc])
                out[trunc] = cand_ids[np.arange(len(trunc)), picked]
                full[trunc] = False
        draw = ops.inverse_cdf_sample if self.kernels else inverse_cdf_sample
        if full.all():
            out[:] = draw(probs, uniform)
        elif full.any():
            out[full] = draw(np.ascontiguousarray(probs[full]), uniform[full])
        return out


@functools.cache
def _xgrammar_bitmask_kernel() -> Callable[[np.ndarray, np.ndarray, list[int]], None] | None:
    """xgrammar's CPU kernel over numpy arrays (zero-copy through torch), or None when unavailable."""
    try:
        import torch
        import xgrammar
    except ImportError:
        return None

    def kernel(logits: np.ndarray, bitmask: np.ndarray, indices: list[int]) -> None:
        xgrammar.apply_token_bitmask_inplace(torch.from_numpy(logits), torch.from_numpy(bitmask), indices=indices)

    return kernel


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray | None = None) -> None:
    """Set the logits of tokens a grammar forbids to -inf, in place, for all constrained rows at once.

    Args:
        logits: ``[S, vocab]`` float32.
        bitmask: ``[m, words]`` int32, one bit per token (set = allowed), little-endian within words.
        rows: the logits row of each bitmask row; ``None`` means rows ``0..m-1``.
    """
    vocab = logits.shape[-1]
    rows = np.arange(len(bitmask)) if rows is None else np.asarray(rows)
    kernel = _xgrammar_bitmask_kernel()
    if kernel is not None and bitmask.shape[1] * 32 >= vocab and logits.dtype == np.float32 and logits.flags.c_contiguous:
        # xgrammar's kernel is ~2.5x faster than unpacking bits in numpy; it wants the mask row-aligned.
        aligned = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)
        aligned[rows] = bitmask
        kernel(logits, aligned, rows.tolist())
        return
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8), axis=-1, bitorder="little")
    allowed = bits[:, :vocab].astype(bool)
    if allowed.shape[1] < vocab:  # ids past the mask's width are never allowed
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    logits[rows] = np.where(allowed, logits[rows], -np.inf)


def seen_token_counts(prompt_token_ids: np.ndarray, output_token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens of a prompt and its outputs, ascending, with how often each was generated."""
    out_ids, out_counts = np.unique(np.asarray(output_token_ids, dtype=np.int64), return_counts=True)
    ids = np.union1d(np.asarray(prompt_token_ids, dtype=np.int64), out_ids)
    counts = np.zeros(len(ids), dtype=np.int32)
    counts[np.searchsorted(ids, out_ids)] = out_counts
    return ids, counts


def apply_penalties(logits: np.ndarray, md: SamplingMetadata) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, in place.

    Only the (row, token) pairs a row has seen change, so the cost is the number of distinct seen
    tokens, not rows x vocabulary.
    """
    rows, ids, counts = md.penalty_token_rows, md.penalty_token_ids, md.output_token_counts
    if rows is None or not len(rows):
        return
    vals = logits[rows, ids]
    rep = md.repetition_penalties[rows]
    vals = np.where(vals > 0, vals / rep, vals * rep)
    vals -= md.frequency_penalties[rows] * counts.astype(np.float32)
    vals -= md.presence_penalties[rows] * (counts > 0)
    logits[rows, ids] = vals


def top_k_top_p_candidates(
    probs: np.ndarray, top_k: np.ndarray | None, top_p: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tokens each row keeps under top-k then top-p (as vLLM orders them), best first.

    Args:
        probs: ``[N, V]`` non-negative, not necessarily normalised.
        top_k: ``[N]``, 0 or >= V = off. top_p: ``[N]``, 1.0 = off.

    Returns:
        ``(rows, ids [R, C], kept [R, C])``: the truncated rows, their candidate tokens by
        decreasing probability (ties: lower id first; a row cut by the value histogram lists its
        kept tokens by id instead) and the kept probabilities (0 = dropped). At least one token
        per row is kept.
    """
    n, vocab = probs.shape
    k = np.zeros(n, dtype=np.int64) if top_k is None else np.asarray(top_k, dtype=np.int64)
    k = np.where((k > 0) & (k < vocab), k, 0)
    p = np.ones(n, dtype=np.float32) if top_p is None else np.asarray(top_p, dtype=np.float32)
    rows = np.flatnonzero((k > 0) | (p < 1.0))
    if not len(rows):
        return rows, np.zeros((0, 1), dtype=np.int64), np.zeros((0, 1), dtype=probs.dtype)
    sub_probs = np.ascontiguousarray(probs if len(rows) == n else probs[rows])
    k, p = k[rows], p[rows]
    use_k = k > 0
    top_p_only = ~use_k & (p < 1.0)
    total = sub_probs.sum(axis=-1) if top_p_only.any() else None
    threshold = _candidate_threshold(sub_probs, np.where(use_k, k, min(_TOP_P_CANDIDATES, vocab)))
    flat, counts, cand_mass = _candidates(sub_probs, threshold)
    complete = threshold <= _SMALLEST_POSITIVE
    enough = np.where(use_k, counts >= k, True)
    if total is not None:
        # A margin over the mass top-p needs, so that rounding never cuts inside the candidates.
        enough &= ~top_p_only | (cand_mass >= p * total * (1 + 1e-4))
    wide: dict[int, np.ndarray] = {}
    short = ~(complete | enough)
    # Top-p over a flat distribution needs most of the vocabulary: sorting all of it cost ~5 ms a
    # row (49,152 tokens), the value histogram a tenth of that.
    histogram = top_p_only & (short | (counts > _HISTOGRAM_FROM)) if sub_probs.dtype == np.float32 else None
    if histogram is not None and histogram.any():
        by_histogram = np.flatnonzero(histogram)
        kept = _top_p_by_histogram(sub_probs[by_histogram], p[by_histogram], total[by_histogram])
        wide = {int(r): ids_r for r, ids_r in zip(by_histogram, kept, strict=True)}
        threshold = np.where(histogram, np.inf, threshold)
        short &= ~histogram
        flat, counts, cand_mass = _candidates(sub_probs, threshold)
    if short.any():
        threshold = np.where(short, _SMALLEST_POSITIVE, threshold)
        flat, counts, cand_mass = _candidates(sub_probs, threshold)

    # Candidates into a [R, C] table, sorted by decreasing probability; the zero padding sorts last.
    r_f = flat // vocab
    width = max(int(counts.max()), 1)
    rank = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    vals = np.zeros((len(rows), width), dtype=probs.dtype)
    ids[r_f, rank] = flat - r_f * vocab
    vals[r_f, rank] = sub_probs.ravel()[flat]
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    vals = np.take_along_axis(vals, order, axis=-1)
    if wide:
        # Rows truncated by the histogram: their kept tokens in id order, already cut to top-p.
        pad = max(map(len, wide.values())) - width
        if pad > 0:
            ids, vals = np.pad(ids, ((0, 0), (0, pad))), np.pad(vals, ((0, 0), (0, pad)))
            width += pad
        for r, ids_r in wide.items():
            ids[r, :len(ids_r)] = ids_r
            vals[r, :len(ids_r)] = sub_probs[r, ids_r]
        p = p.copy()
        p[list(wide)] = 1.0

    col = np.arange(width)
    vals = np.where(col < np.where(use_k, k, width)[:, None], vals, 0)
    if (p < 1.0).any():
        # top-p applies to the distribution left after top-k: the smallest prefix whose mass
        # reaches p (the first token always stays).
        cum = np.cumsum(vals, axis=-1, dtype=np.float64)
        mass = cum[:, -1] if total is None else np.where(use_k, cum[:, -1], total)
        cum /= mass[:, None]
        cut = np.where(p < 1.0, (cum < p[:, None]).sum(axis=-1) + 1, width)
        vals = np.where(col < cut[:, None], vals, 0)
    return rows, ids, vals


def _top_p_by_histogram(probs: np.ndarray, top_p: np.ndarray, total: np.ndarray) -> list[np.ndarray]:
    """Per row of ``probs`` (float32, C-contiguous), the ids top-p keeps, ascending, without sorting the row.

    The tokens are binned by the upper bits of their float32 pattern (monotonic in the value for
    non-negative floats, so a bin spans ~3% of values); only the members of the bin where the
    mass from the top reaches ``top_p`` of ``total`` (the row's float32 sum, as the sorted path
    divides by) are sorted, so the kept set is the one of a full sort (ties: lower id first) up
    to float64 rounding: the bins above the cut are summed in id order, not in value order. Each
    row's result depends on that row alone.
    """
    n, vocab = probs.shape
    shift, bins = 18, 1 << 14
    key = (probs.view(np.uint32) >> shift).astype(np.int64)
    key += (np.arange(n, dtype=np.int64) * bins)[:, None]
    mass = np.bincount(key.ravel(), weights=probs.ravel(), minlength=n * bins).reshape(n, bins)
    from_top = np.cumsum(mass[:, ::-1], axis=-1)[:, ::-1]  # mass of the bins at or above each bin
    # A top_p that rounded to 0 in float32 still keeps the best token, as the sorted path does.
    target = np.maximum(top_p.astype(np.float64) * total, np.finfo(np.float32).smallest_subnormal)
    # (At least bin 0: a float32 total rounded above the bins' float64 sum must not wrap into the row before.)
    cut = np.maximum((from_top >= target[:, None]).sum(axis=-1) - 1, 0) + np.arange(n) * bins  # as a key
    above = np.append(from_top.ravel(), 0.0)[cut + 1]
    above[(cut + 1) % bins == 0] = 0.0  # the cut is a row's top bin
    keep = key > cut[:, None]
    # The cut bins' members, by row, decreasing value, then id; their running mass from the top.
    members = np.flatnonzero(key == cut[:, None])
    row = members // vocab
    value = probs.ravel()[members]
    order = np.lexsort((members, -value, row))
    members, row, value = members[order], row[order], value[order]
    first = np.searchsorted(row, np.arange(n))
    rank = np.arange(len(members)) - first[row]
    # Each row's running sum on its own (one sum over the batch would let other rows' mass round
    # this row's low bits: its kept set would depend on the batch).
    running = np.zeros((n, int(rank.max(initial=-1)) + 2))
    running[:, 0] = above
    running[row, rank + 1] = value
    running = np.cumsum(running, axis=-1)[row, rank + 1]
    before_target = np.bincount(row, weights=running / total[row] < top_p[row], minlength=n).astype(np.int64)
    take = np.minimum(before_target + 1, np.bincount(row, minlength=n))
    keep.ravel()[members[rank < take[row]]] = True
    keep &= probs > 0
    return [np.flatnonzero(k) for k in keep]


def _candidate_threshold(probs: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per row, a value with (very likely) at least ``target`` tokens at or above it, from a strided sample."""
    sample = probs[:, ::_STRIDE]
    m = sample.shape[-1]
    j = np.minimum(-(-target // _STRIDE) + _STRIDE_MARGIN, m)
    kth = m - j
    part = np.partition(sample, np.unique(kth), axis=-1)
    threshold = part[np.arange(len(probs)), kth]
    # Zero-probability tokens are never candidates; a row with fewer positive tokens keeps them all.
    return np.maximum(threshold, _SMALLEST_POSITIVE)


def _candidates(probs: np.ndarray, threshold: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flat indices (row-major) of the tokens at or above each row's threshold, their count and mass per row.

    ``probs`` is C-contiguous, so a flat index addresses ``probs.ravel()`` without a copy.
    """
    flat = np.flatnonzero(probs >= threshold[:, None])
    rows = flat // probs.shape[-1]
    counts = np.bincount(rows, minlength=len(probs))
    mass = np.bincount(rows, weights=probs.ravel()[flat], minlength=len(probs))
    return flat, counts, mass


def apply_top_k_top_p(probs: np.ndarray, top_k: np.ndarray | None, top_p: np.ndarray | None) -> np.ndarray:
    """Zero the probabilities outside each row's top-k and top-p set (a new array when any row changes)."""
    rows, ids, kept = top_k_top_p_candidates(probs, top_k, top_p)
    if not len(rows):
        return probs
    out = probs.copy()
    out[rows] = 0
    nz = kept > 0
    out[np.broadcast_to(rows[:, None], ids.shape)[nz], ids[nz]] = kept[nz]
    return out


def inverse_cdf_sample(weights: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Column drawn per row with probability proportional to ``weights`` [n, m], given one U[0, 1) per row.

    Two levels: the block holding the row's quantile, from per-block sums, then the token inside
    that block; the picked token always has positive weight.
    """
    n, m = weights.shape
    ar = np.arange(n)
    if m <= 2 * _CDF_BLOCK:
        cum = np.cumsum(weights, axis=-1, dtype=np.float64)
        return _first_above(cum, uniform * cum[:, -1], weights)
    starts = np.arange(0, m, _CDF_BLOCK)
    block_cum = np.cumsum(np.add.reduceat(weights, starts, axis=-1), axis=-1, dtype=np.float64)
    target = uniform * block_cum[:, -1]
    block = np.minimum((block_cum <= target[:, None]).sum(axis=-1), len(starts) - 1)
    target -= np.where(block > 0, block_cum[ar, block - 1], 0.0)
    cols = starts[block][:, None] + np.arange(_CDF_BLOCK)
    inside = cols < m
    cols = np.minimum(cols, m - 1)
    block_weights = np.where(inside, weights[ar[:, None], cols], 0)
    picked = _first_above(np.cumsum(block_weights, axis=-1, dtype=np.float64), target, block_weights)
    return cols[ar, picked]


def _first_above(cum: np.ndarray, target: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """First column whose cumulative weight exceeds ``target``; rounding past the end gives the last positive one."""
    picked = (cum <= target[:, None]).sum(axis=-1)
    last_positive = weights.shape[-1] - 1 - np.argmax(weights[:, ::-1] > 0, axis=-1)
    return np.minimum(picked, last_positive)
