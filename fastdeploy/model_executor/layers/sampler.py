"""Token sampling for a whole batch at once.

The order follows vLLM: logprobs are taken from the raw logits; then allowed
tokens, bad words, logit bias, min_tokens and penalties shape the logits;
greedy rows take the argmax; random rows apply temperature, min_p, top-k and
top-p and draw with the exponential-race trick (argmax of p / q, q ~ Exp(1)),
with per-request generators for seeded requests so a seeded request samples
the same tokens whatever else is in the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

_SAMPLING_EPS = 1e-5
# Top-p first looks at this many best tokens; only when they hold less than top_p
# of the mass does it fall back to sorting the whole vocabulary.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of the rows sampled this step (row = one request)."""

    temperature: np.ndarray  # [S] float32; < eps means greedy
    all_greedy: bool
    top_p: np.ndarray | None = None  # [S] float32, 1.0 = off
    top_k: np.ndarray | None = None  # [S] int64, 0 = off
    min_p: np.ndarray | None = None  # [S] float32, 0 = off
    generators: dict[int, np.random.Generator] = field(default_factory=dict)
    # None: no logprobs this step; -1: the whole vocabulary.
    max_num_logprobs: int | None = None
    # Penalties: rows listed here only.
    presence_penalties: np.ndarray | None = None
    frequency_penalties: np.ndarray | None = None
    repetition_penalties: np.ndarray | None = None
    prompt_token_ids: list[np.ndarray] | None = None
    output_token_ids: list[list[int]] | None = None
    # row -> token ids that may not be sampled yet (stop tokens under min_tokens).
    min_tokens_block: dict[int, list[int]] = field(default_factory=dict)
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    bad_words_token_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    # Structured outputs: allowed-token bitmask rows [m, ceil(vocab / 32)] int32 (xgrammar's
    # layout, bit i of word j = token 32 * j + i) and the sampled row each one applies to.
    grammar_bitmask: np.ndarray | None = None
    grammar_rows: np.ndarray | None = None


@dataclass
class LogprobsArrays:
    """Chosen token first, then the top-k, per row."""

    token_ids: np.ndarray  # [S, k + 1] int64
    logprobs: np.ndarray  # [S, k + 1] float32
    ranks: np.ndarray  # [S] int64, rank of the chosen token (1 = best)


@dataclass
class SamplerOutput:
    sampled_token_ids: np.ndarray  # [S] int64
    logprobs: LogprobsArrays | None


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def gather_logprobs(logprobs: np.ndarray, token_ids: np.ndarray, num_logprobs: int) -> LogprobsArrays:
    """The chosen tokens' logprobs and ranks plus the top ``num_logprobs`` (-1 = all) of each row."""
    rows = np.arange(logprobs.shape[0])
    chosen = logprobs[rows, token_ids]
    ranks = (logprobs > chosen[:, None]).sum(axis=-1) + 1
    k = logprobs.shape[-1] if num_logprobs == -1 else min(num_logprobs, logprobs.shape[-1])
    if k > 0:
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


class Sampler:
    """Samples one token per row from ``[S, vocab]`` fp32 logits."""

    def __init__(self) -> None:
        self._rng = np.random.default_rng()

    def __call__(self, logits: np.ndarray, md: SamplingMetadata) -> SamplerOutput:
        if md.grammar_bitmask is not None:
            # Before the logprobs, as in vLLM: a constrained request's logprobs are those of the
            # distribution it actually samples from.
            logits = logits.copy()
            apply_token_bitmask(logits, md.grammar_bitmask, md.grammar_rows)
        raw_logprobs = log_softmax(logits) if md.max_num_logprobs is not None else None
        logits = self.apply_logits_processors(logits.copy(), md)
        greedy = logits.argmax(axis=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = np.where(md.temperature < _SAMPLING_EPS, greedy, self.sample_random(logits, md))
        sampled = sampled.astype(np.int64)
        lp = None if raw_logprobs is None else gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, lp)

    @staticmethod
    def apply_logits_processors(logits: np.ndarray, md: SamplingMetadata) -> np.ndarray:
        for row, allowed in md.allowed_token_ids.items():
            keep = logits[row, allowed].copy()
            logits[row] = -np.inf
            logits[row, allowed] = keep
        for row, words in md.bad_words_token_ids.items():
            past = md.output_token_ids[row] if md.output_token_ids is not None else []
            for word in words:
                prefix = word[:-1]
                if not prefix or (len(past) >= len(prefix) and list(past[-len(prefix) :]) == prefix):
                    logits[row, word[-1]] = -np.inf
        for row, bias in md.logit_bias.items():
            ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
            logits[row, ids] += np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        for row, stop_ids in md.min_tokens_block.items():
            logits[row, stop_ids] = -np.inf
        if md.repetition_penalties is not None:
            apply_penalties(logits, md)
        return logits

    def sample_random(self, logits: np.ndarray, md: SamplingMetadata) -> np.ndarray:
        temp = np.where(md.temperature < _SAMPLING_EPS, 1.0, md.temperature).astype(np.float32)
        logits = logits / temp[:, None]
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        if md.min_p is not None:
            threshold = probs.max(axis=-1, keepdims=True) * md.min_p[:, None]
            probs = np.where(probs < threshold, 0.0, probs)
        if md.top_k is not None or md.top_p is not None:
            probs = apply_top_k_top_p(probs, md.top_k, md.top_p)
        q = self._rng.exponential(size=probs.shape).astype(np.float32)
        for row, gen in md.generators.items():
            q[row] = gen.exponential(size=probs.shape[-1])
        return (probs / q).argmax(axis=-1)


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


def apply_penalties(logits: np.ndarray, md: SamplingMetadata) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, in place."""
    vocab = logits.shape[-1]
    for row in range(logits.shape[0]):
        rep = md.repetition_penalties[row]
        pres = md.presence_penalties[row]
        freq = md.frequency_penalties[row]
        if rep == 1.0 and pres == 0.0 and freq == 0.0:
            continue
        out_counts = np.bincount(np.asarray(md.output_token_ids[row], dtype=np.int64), minlength=vocab)[:vocab]
        if rep != 1.0:
            seen = out_counts > 0
            seen[md.prompt_token_ids[row]] = True
            row_logits = logits[row]
            logits[row] = np.where(seen, np.where(row_logits > 0, row_logits / rep, row_logits * rep), row_logits)
        if freq != 0.0:
            logits[row] -= freq * out_counts
        if pres != 0.0:
            logits[row] -= pres * (out_counts > 0)


def apply_top_k_top_p(probs: np.ndarray, top_k: np.ndarray | None, top_p: np.ndarray | None) -> np.ndarray:
    """Zero the probabilities outside each row's top-k and top-p set."""
    vocab = probs.shape[-1]
    out = probs
    for row in range(probs.shape[0]):
        k = int(top_k[row]) if top_k is not None else 0
        p = float(top_p[row]) if top_p is not None else 1.0
        if (k <= 0 or k >= vocab) and p >= 1.0:
            continue
        row_probs = probs[row]
        use_k = 0 < k < vocab
        n = k if use_k else (min(_TOP_P_CANDIDATES, vocab) if p < 1.0 else vocab)
        cand = np.argpartition(-row_probs, n - 1)[:n] if n < vocab else np.arange(vocab)
        cand = cand[np.argsort(-row_probs[cand], kind="stable")]
        if p < 1.0:
            # top-p applies to the distribution left after top-k, as in vLLM.
            total = row_probs[cand].sum() if use_k else row_probs.sum()
            cum = np.cumsum(row_probs[cand]) / total
            if not use_k and cum[-1] < p and len(cand) < vocab:
                cand = np.argsort(-row_probs, kind="stable")
                cum = np.cumsum(row_probs[cand]) / total
            # Keep the smallest prefix whose mass reaches p (always at least one token).
            cand = cand[: int(np.searchsorted(cum, p)) + 1]
        kept = np.zeros(vocab, dtype=probs.dtype)
        kept[cand] = row_probs[cand]
        if out is probs:
            out = probs.copy()
        out[row] = kept
    return out
