"""Exact verification of draft tokens (Leviathan et al., 2023) for one-hot drafts.

Every proposer here (ngram, suffix, the draft model's greedy drafts, as vLLM's default
``draft_sample_method="greedy"``) proposes tokens without a distribution, so q is one-hot on
the draft token d. Leviathan's rule then reads: keep d with probability min(1, p(d) / 1) = p(d);
on rejection draw from max(p - q, 0) normalised, which is p with d removed. Drawing the target's
own token t ~ p at a position and keeping d exactly when t == d does both at once: P(keep) =
p(d), and a rejected position's t is p conditioned on t != d. So verification is:

1. the target's tokens t_0..t_k at the k + 1 positions [last token, d_1..d_k], sampled by the
   ordinary :class:`~fastdeploy.model_executor.layers.sampler.Sampler` on the processed
   distribution of each position (temperature, top-k/top-p/min-p, logit bias, allowed tokens,
   the grammar's mask at that position); greedy rows take the argmax, which makes this "accept
   while the draft equals the argmax, then the target's token";
2. the accepted length a = the first j with t_j != d_{j+1} (k when all match);
3. the output t_0..t_a: the accepted drafts (equal to the t's) and the target's token after them
   (the resampled one on rejection, the bonus one otherwise).

Each position draws one uniform from the request's generator when it is seeded, in position
order, so a seeded request is reproducible run to run. The logprobs of an output token are the
sampler's for its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastdeploy.model_executor.layers.sampler import SamplingMetadata


@dataclass
class VerifiedTokens:
    """Per sampled request: how many of its drafts were accepted and where its output rows are."""

    num_accepted: np.ndarray  # [R] int64
    # Output rows of request i: rows starts[i] .. starts[i] + num_accepted[i] of the sampled rows.
    starts: np.ndarray  # [R] int64


def verify(sampled: np.ndarray, draft_tokens: np.ndarray, num_drafts: np.ndarray) -> VerifiedTokens:
    """Accepted lengths of every request at once.

    Args:
        sampled: ``[sum(num_drafts + 1)]`` the target's token at each verified position,
            request after request (a request without drafts has one position).
        draft_tokens: ``[sum(num_drafts)]`` the drafts, request after request.
        num_drafts: ``[R]`` drafts per request (0 = no speculation).
    """
    num_pos = num_drafts + 1
    starts = np.cumsum(num_pos) - num_pos
    num_accepted = np.zeros(len(num_drafts), dtype=np.int64)
    if len(draft_tokens):
        # The target token at the position before each draft (drafts follow position 0 .. k-1).
        owner = np.repeat(np.arange(len(num_drafts)), num_drafts)
        offset = np.arange(len(draft_tokens)) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
        match = sampled[starts[owner] + offset] == draft_tokens
        # A draft counts only when every draft before it matched: the first mismatch per request.
        mismatch_pos = np.where(match, np.iinfo(np.int64).max, offset)
        first_mismatch = np.full(len(num_drafts), np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(first_mismatch, owner, mismatch_pos)
        num_accepted = np.minimum(first_mismatch, num_drafts)
    return VerifiedTokens(num_accepted, starts)


def _repeat_table(pos: np.ndarray, counts: np.ndarray, new_start: np.ndarray, *values: np.ndarray
                  ) -> tuple[np.ndarray, ...]:
    """A flat ``(positions, values...)`` table with each entry repeated at every position of its row."""
    reps = counts[pos]
    first = np.cumsum(reps) - reps
    intra = np.arange(int(reps.sum())) - np.repeat(first, reps)
    new_pos = np.repeat(new_start[pos], reps) + intra
    # Grouped by position again, entries in their order within a row (logprob_token_ids relies on it).
    order = np.argsort(new_pos, kind="stable")
    return (new_pos[order], *(np.repeat(v, reps, axis=0)[order] for v in values))


def expand_sampling_metadata(md: SamplingMetadata, counts: np.ndarray) -> SamplingMetadata:
    """``md`` (one row per request) with request i's row repeated ``counts[i]`` times, in place order.

    Settings that depend on the tokens before a position (penalties, bad words, min_tokens) are
    the row's own at every position: the proposers give such requests no drafts, so their
    ``counts`` is 1. The grammar bitmask is not expanded: its rows are per position already.
    """
    if (counts == 1).all():
        return md
    new_start = np.cumsum(counts) - counts
    rep = np.repeat(np.arange(len(counts)), counts)

    def per_row(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[rep]

    out = SamplingMetadata(temperature=md.temperature[rep], all_greedy=md.all_greedy, top_p=per_row(md.top_p),
                           top_k=per_row(md.top_k), min_p=per_row(md.min_p),
                           max_num_logprobs=md.max_num_logprobs,
                           presence_penalties=per_row(md.presence_penalties),
                           frequency_penalties=per_row(md.frequency_penalties),
                           repetition_penalties=per_row(md.repetition_penalties))
    # One generator per request, consulted once per position in position order.
    out.generators = {int(new_start[pos]) + j: gen for pos, gen in md.generators.items()
                      for j in range(int(counts[pos]))}
    if md.logprob_token_ids is not None:
        out.logprob_token_ids = _repeat_table(md.logprob_token_ids[0], counts, new_start, md.logprob_token_ids[1])
    if md.penalty_token_rows is not None:
        out.penalty_token_rows, out.penalty_token_ids, out.output_token_counts = _repeat_table(
            md.penalty_token_rows, counts, new_start, md.penalty_token_ids, md.output_token_counts)
    if md.logit_bias is not None:
        out.logit_bias = _repeat_table(md.logit_bias[0], counts, new_start, *md.logit_bias[1:])
    if md.allowed_token_ids is not None:
        out.allowed_token_ids = _repeat_table(md.allowed_token_ids[0], counts, new_start, md.allowed_token_ids[1])
    if md.blocked_token_ids is not None:
        out.blocked_token_ids = _repeat_table(md.blocked_token_ids[0], counts, new_start, md.blocked_token_ids[1])
    return out
