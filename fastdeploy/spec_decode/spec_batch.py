"""Laying out a step's draft tokens in the runner's flattened batch (vLLM's spec-decode metadata)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fastdeploy.spec_decode.rejection_sampler import verify

if TYPE_CHECKING:
    from fastdeploy.engine.sched.output import SchedulerOutput
    from fastdeploy.model_executor.layers.sampler import LogprobsArrays
    from fastdeploy.worker.input_batch import InputBatch


def output_rows(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``starts[i] .. starts[i] + counts[i] - 1`` for every i, concatenated."""
    first = np.cumsum(counts) - counts
    return np.repeat(starts, counts) + np.arange(int(counts.sum())) - np.repeat(first, counts)


def write_draft_tokens(batch: InputBatch, spec: dict[str, list[int]], req_ids: list[str], rows: np.ndarray,
                       ) -> np.ndarray:
    """Put each request's drafts after its known tokens (``num_tokens`` unchanged); drafts per request."""
    num_drafts = np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids))
    sel = np.flatnonzero(num_drafts)
    cols = output_rows(batch.num_tokens[rows[sel]], num_drafts[sel])
    batch.token_ids[np.repeat(rows[sel], num_drafts[sel]), cols] = np.fromiter(
        (t for i in sel.tolist() for t in spec[req_ids[i]]), dtype=np.int64, count=int(num_drafts[sel].sum()))
    return num_drafts


def spec_grammar_rows(so: SchedulerOutput, req_ids: list[str], num_pos: np.ndarray,
                      ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The grammar bitmask rows of every verified position of the constrained requests among ``req_ids``.

    Returns ``(bitmask [m, words], positions [m])`` in the expanded (one row per position) layout.
    """
    if so.grammar_bitmask is None:
        return None, None
    new_start = np.cumsum(num_pos) - num_pos
    sel = [j for j, r in enumerate(req_ids) if r in so.structured_output_request_ids]
    if not sel:
        return None, None
    sel_arr = np.asarray(sel, dtype=np.int64)
    first = np.fromiter((so.structured_output_request_ids[req_ids[j]] for j in sel), dtype=np.int64, count=len(sel))
    counts = num_pos[sel_arr]
    return so.grammar_bitmask[output_rows(first, counts)], output_rows(new_start[sel_arr], counts)


def accept_verified(batch: InputBatch, rows: np.ndarray, req_ids: list[str], spec: dict[str, list[int]],
                    num_pos: np.ndarray, sampled: np.ndarray, logprobs: LogprobsArrays | None,
                    ) -> tuple[np.ndarray, np.ndarray, LogprobsArrays | None, dict[str, list[int]]]:
    """Each sampled request's output after verification, appended to its batch row.

    Args:
        rows, req_ids: the sampled requests (batch rows and ids), in sampling order.
        num_pos: ``[R]`` verified positions per request (drafts + 1).
        sampled, logprobs: the sampler's token (and logprobs) at every verified position.

    Returns:
        ``(counts [R], tokens, logprobs, {req_id: tokens})``: how many tokens each request keeps
        (accepted drafts + 1), those tokens and their logprob rows, request after request.
    """
    drafts = np.fromiter((t for r in req_ids for t in spec.get(r, ())), dtype=np.int64, count=int((num_pos - 1).sum()))
    counts = verify(sampled, drafts, num_pos - 1).num_accepted + 1
    keep = output_rows(np.cumsum(num_pos) - num_pos, counts)
    tokens = sampled[keep]
    ends = np.cumsum(counts)
    # One column of the runs at a time: O(k) vectorized appends, not O(tokens) Python.
    for j in range(int(counts.max())):
        has = np.flatnonzero(counts > j)
        batch.append_sampled(rows[has], tokens[ends[has] - counts[has] + j])
    per_request = {r: t.tolist() for r, t in zip(req_ids, np.split(tokens, ends[:-1]), strict=True)}
    return counts, tokens, None if logprobs is None else logprobs.take(keep), per_request
