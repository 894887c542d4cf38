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
   the grammar's mask at that position, and the penalties, ``min_tokens`` and bad words in the
   state position j would have with d_1..d_j accepted: the persistent batch's
   ``make_sampling_metadata(rows, num_pos)`` builds those rows); greedy rows take the argmax,
   which makes this "accept while the draft equals the argmax, then the target's token";
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
