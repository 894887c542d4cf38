"""Per-step attention metadata shared by every attention layer of a forward.

:func:`build_attention_metadata` turns a step's schedule (per sequence: its block-table
row, how many new tokens it has, how long its context is) into the tensors the
paged-attention kernel reads, with numpy over whole arrays (no per-token Python).

The plain-Paddle attention path (used when the C++ kernels are unavailable, and by
the PaddleFormers backend) wants a different, gathered view: per-decode slot lists
with a padding mask and per-prefill context slots. Those fields are derived from the
same host arrays the first time something reads them, so a step on the kernel path
never pays for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle


@dataclass
class PrefillSeqMetadata:
    """One sequence that has more than one query token in this step.

    Its query tokens are rows ``[query_start, query_start + query_len)`` of the
    flattened batch; ``context_slots`` are the flat KV-cache rows of its whole
    context (cached prefix + earlier chunks + this chunk), in position order.
    Query token ``i`` sits at position ``context_len - query_len + i`` and sees
    keys ``0 .. context_len - query_len + i`` (causal).
    """

    query_start: int
    query_len: int
    context_len: int
    context_slots: paddle.Tensor  # [context_len] int64
    causal_mask: paddle.Tensor | None = None  # [query_len, context_len] additive fp32, 0 / -inf


@dataclass
class HostMetadata:
    """numpy copies of the step's layout, kept for deriving the plain-Paddle path's fields."""

    block_tables: np.ndarray  # [S, max_blocks] int64
    query_lens: np.ndarray  # [S] int64
    seq_lens: np.ndarray  # [S] int64, context length including this step's tokens
    block_size: int


class AttentionMetadata:
    """How the flattened, unpadded token batch ``[num_tokens, ...]`` maps onto the paged cache.

    Tokens are ordered decodes first (one query token per request), then the
    prefill (or chunked-prefill) sequences one after another.

    Kernel fields (None when the metadata was built by hand without them):
    ``query_start_loc`` [S + 1], ``seq_lens`` [S] and ``block_tables`` [S, max_blocks], int64.

    Gathered fields for the plain-Paddle path: ``decode_slots`` [num_decodes, max_context]
    (flat cache rows of every context position, padded to the longest), ``decode_mask``
    [num_decodes, 1, 1, max_context] (0 / -inf for padding) and ``prefills``; passed in,
    or derived from ``host`` on first access.
    """

    def __init__(
        self,
        num_tokens: int,
        slot_mapping: paddle.Tensor,
        num_decodes: int = 0,
        decode_slots: paddle.Tensor | None = None,
        decode_mask: paddle.Tensor | None = None,
        prefills: list[PrefillSeqMetadata] | None = None,
        query_start_loc: paddle.Tensor | None = None,
        seq_lens: paddle.Tensor | None = None,
        block_tables: paddle.Tensor | None = None,
        host: HostMetadata | None = None,
    ) -> None:
        self.num_tokens = num_tokens
        # Flat KV-cache row (block_id * block_size + offset) that each token's K/V is written to.
        self.slot_mapping = slot_mapping  # [num_tokens] int64
        self.num_decodes = num_decodes
        self.query_start_loc = query_start_loc
        self.seq_lens = seq_lens
        self.block_tables = block_tables
        self.host = host
        self._decode_slots = decode_slots
        self._decode_mask = decode_mask
        self._prefills = prefills

    @property
    def has_kernel_fields(self) -> bool:
        """Whether the paged-attention kernel can run on this metadata."""
        return self.block_tables is not None and self.query_start_loc is not None and self.seq_lens is not None

    @property
    def decode_slots(self) -> paddle.Tensor | None:
        if self._decode_slots is None and self.num_decodes and self.host is not None:
            self._derive_decodes()
        return self._decode_slots

    @decode_slots.setter
    def decode_slots(self, value: paddle.Tensor | None) -> None:
        self._decode_slots = value

    @property
    def decode_mask(self) -> paddle.Tensor | None:
        if self._decode_mask is None and self.num_decodes and self.host is not None:
            self._derive_decodes()
        return self._decode_mask

    @decode_mask.setter
    def decode_mask(self, value: paddle.Tensor | None) -> None:
        self._decode_mask = value

    @property
    def prefills(self) -> list[PrefillSeqMetadata]:
        if self._prefills is None:
            self._prefills = self._derive_prefills() if self.host is not None else []
        return self._prefills

    @prefills.setter
    def prefills(self, value: list[PrefillSeqMetadata]) -> None:
        self._prefills = value

    def _derive_decodes(self) -> None:
        h, nd = self.host, self.num_decodes
        ctx = h.seq_lens[:nd]
        grid = np.arange(int(ctx.max()))
        pos = np.minimum(grid[None, :], (ctx - 1)[:, None])  # padding repeats the last slot, masked below
        slots = _slots(h.block_tables[:nd], pos, h.block_size)
        mask = np.where(grid[None, :] < ctx[:, None], 0.0, -np.inf).astype(np.float32)
        self._decode_slots = paddle.to_tensor(slots)
        self._decode_mask = paddle.to_tensor(mask.reshape(nd, 1, 1, -1))

    def _derive_prefills(self) -> list[PrefillSeqMetadata]:
        h = self.host
        starts = np.cumsum(h.query_lens) - h.query_lens
        out = []
        for i in range(self.num_decodes, len(h.query_lens)):
            ctx_len = int(h.seq_lens[i])
            slots = _slots(h.block_tables[i], np.arange(ctx_len), h.block_size)
            out.append(PrefillSeqMetadata(int(starts[i]), int(h.query_lens[i]), ctx_len, paddle.to_tensor(slots)))
        return out


def _slots(block_rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Flat cache rows of ``positions`` through block-table rows (broadcasting like numpy indexing)."""
    blocks = np.take_along_axis(block_rows, positions // block_size, axis=-1)
    return blocks * block_size + positions % block_size


def build_attention_metadata(
    block_tables: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray, block_size: int
) -> tuple[AttentionMetadata, np.ndarray]:
    """The metadata of one step, and each token's position ``[num_tokens]``.

    Args:
        block_tables: ``[S, max_blocks]`` int64, each scheduled sequence's block ids (columns
            past its last block are ignored); decodes (one new token) must come first.
        query_lens: ``[S]`` new tokens of each sequence this step.
        seq_lens: ``[S]`` context length after this step (cached + new tokens).
        block_size: tokens per cache block.
    """
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    cu = np.cumsum(query_lens)
    num_tokens = int(cu[-1]) if len(cu) else 0
    starts = cu - query_lens
    # Token t of sequence s sits at position seq_len - query_len + (t - start).
    positions = np.repeat(seq_lens - query_lens - starts, query_lens) + np.arange(num_tokens)
    token_seq = np.repeat(np.arange(len(query_lens)), query_lens)
    slot_mapping = block_tables[token_seq, positions // block_size] * block_size + positions % block_size
    num_decodes = int(np.cumprod(query_lens == 1).sum())  # the leading run of one-token sequences
    md = AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=paddle.to_tensor(slot_mapping),
        num_decodes=num_decodes,
        query_start_loc=paddle.to_tensor(np.concatenate([[0], cu]).astype(np.int64)),
        seq_lens=paddle.to_tensor(seq_lens),
        block_tables=paddle.to_tensor(block_tables),
        host=HostMetadata(block_tables, query_lens, seq_lens, block_size),
    )
    return md, positions
