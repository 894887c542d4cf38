"""Per-step attention metadata shared by every attention layer of a forward."""

from __future__ import annotations

from dataclasses import dataclass, field

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
class AttentionMetadata:
    """How the flattened, unpadded token batch ``[num_tokens, ...]`` maps onto the paged cache.

    Tokens are ordered decodes first (one query token per request), then the
    prefill (or chunked-prefill) sequences one after another.
    """

    num_tokens: int
    # Flat KV-cache row (block_id * block_size + offset) that each token's K/V is written to.
    slot_mapping: paddle.Tensor  # [num_tokens] int64
    num_decodes: int = 0
    # For the decode rows: flat cache rows of every context position, padded to the longest.
    decode_slots: paddle.Tensor | None = None  # [num_decodes, max_context_len] int64
    # Additive mask for the padding of decode_slots (0 for real positions, -inf for padding).
    decode_mask: paddle.Tensor | None = None  # [num_decodes, 1, 1, max_context_len] fp32
    prefills: list[PrefillSeqMetadata] = field(default_factory=list)
