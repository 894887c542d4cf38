"""Prompt lookup (ngram) drafts: the tokens that followed the last earlier occurrence of the context's tail.

For each request the longest tail of its tokens (prompt + output), between ``prompt_lookup_min``
and ``prompt_lookup_max`` tokens, that also occurs earlier in them is found, and the up to k
tokens that followed its first occurrence are the drafts (vLLM's rule: longest match, earliest
occurrence). The whole batch is matched at once over a ``[R, L]`` window of the rows' tokens:
``prompt_lookup_max`` vectorized passes, no per-request Python loop.
"""

from __future__ import annotations

import numpy as np

# Only the last this-many tokens of a row are searched (vLLM bounds its search the same way):
# keeps a step's work O(batch x window) whatever the context length.
_MAX_SEARCH_WINDOW = 4096


class NgramProposer:
    """Drafts from prompt lookup over prompt + output."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray) -> list[list[int]]:
        """Drafts for each row.

        Args:
            token_ids: ``[R, >= max(num_tokens)]`` the rows' tokens (positions past ``num_tokens`` ignored).
            num_tokens: ``[R]`` each row's length.
        """
        num_rows = len(num_tokens)
        if num_rows == 0:
            return []
        width = int(min(num_tokens.max(), _MAX_SEARCH_WINDOW))
        # Right-aligned window: column width-1 is each row's last token.
        start = np.maximum(num_tokens - width, 0)
        cols = start[:, None] + np.arange(width)
        valid = cols < num_tokens[:, None]
        win = np.where(valid, token_ids[np.arange(num_rows)[:, None], np.minimum(cols, token_ids.shape[1] - 1)], -1)
        length = np.minimum(num_tokens, width)
        # Shift each row so its last token sits in the last column.
        shift = width - length
        idx = (np.arange(width)[None, :] - shift[:, None]) % width
        win = np.take_along_axis(win, idx, axis=1)
        valid = np.arange(width)[None, :] >= shift[:, None]
        # match_len[r, e]: how many tokens ending at column e equal the row's tail (capped at max_n).
        match_len = np.zeros((num_rows, width), dtype=np.int64)
        alive = valid.copy()
        for j in range(self.max_n):
            tail_tok = win[:, width - 1 - j]
            shifted = np.full((num_rows, width), -2, dtype=win.dtype)
            if j:
                shifted[:, j:] = win[:, :-j]
            else:
                shifted[:] = win
            ok = np.zeros((num_rows, width), dtype=bool)
            ok[:, j:] = valid[:, : width - j] if j else valid
            alive &= ok & (shifted == tail_tok[:, None]) & (j < length)[:, None]
            match_len += alive
        # An occurrence must end before the last token, and leave at least one token after it.
        match_len[:, width - 1] = 0
        match_len = np.where(match_len >= self.min_n, match_len, 0)
        best = match_len.max(axis=1)
        # Earliest occurrence of the longest match.
        end = np.argmax(match_len == best[:, None], axis=1)
        out: list[list[int]] = []
        for r in range(num_rows):
            if best[r] == 0:
                out.append([])
                continue
            a = int(end[r]) + 1
            out.append(win[r, a : min(a + self.k, width)].tolist())
        return out
