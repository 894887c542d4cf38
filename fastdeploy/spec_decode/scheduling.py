"""The scheduler's side of speculative decoding: drafts kept per request, grammar checks, statistics.

A request's drafts (``Request.spec_token_ids``) come back with the step that sampled its newest
token. Before they are kept they are cut to what the request can still use (``max_tokens``,
``max_model_len``) and, for a constrained request, to the longest prefix its grammar accepts
(vLLM's ``validate_tokens``: the matcher advances over them and rolls back). Next step the
scheduler gives the request ``1 + len(drafts)`` tokens of the budget (``scheduled_spec_decode_tokens``),
with KV slots for all of them; after verification the rejected ones are taken back from
``num_computed_tokens`` so their slots are written again by the next step, and only blocks whose
tokens are all accepted are ever hashed into the prefix cache (the cache keys on
``all_token_ids``, which holds accepted tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from fastdeploy.engine.request import Request
    from fastdeploy.model_executor.guided_decoding.manager import StructuredOutputManager


@dataclass
class SpecDecodingStats:
    """Draft counts since the last stats (vLLM's SpecDecodingStats)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def take(self) -> SpecDecodingStats | None:
        """The counts so far (None when no draft was verified), and a fresh start."""
        if not self.num_drafts:
            return None
        out = SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens
        return out


def usable_drafts(request: Request, drafts: list[int], max_model_len: int,
                  manager: StructuredOutputManager | None) -> list[int]:
    """The drafts the request keeps: within its token limits and, when constrained, its grammar."""
    room = min(request.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens)
    drafts = drafts[: max(room, 0)]
    if not drafts or not request.use_structured_output:
        return drafts
    so_request = request.structured_output_request
    grammar = so_request.grammar if so_request is not None else None
    if grammar is None or manager is None or not manager.should_fill_bitmask(request) or grammar.is_terminated():
        # While the model reasons the grammar does not read its tokens; then it has no drafts,
        # so the step that ends the reasoning is never in the middle of a verified run.
        return []
    return drafts[: grammar.validate_tokens(drafts)]


def spec_grammar_bitmask(manager: StructuredOutputManager, requests: list[Request],
                         spec_tokens: dict[str, list[int]]) -> tuple[np.ndarray | None, dict[str, int]]:
    """The bitmask rows of the constrained requests sampling this step, one per verified position.

    A request with drafts d_1..d_k gets k + 1 rows: the grammar's mask now, then after each of
    d_1..d_j (advanced over them, then rolled back); the others one row, as without speculation.
    """
    plain = [r for r in requests if r.request_id not in spec_tokens]
    with_drafts = [r for r in requests if r.request_id in spec_tokens]
    bitmask, rows = manager.grammar_bitmask(plain) if plain else (None, {})
    parts = [] if bitmask is None else [bitmask]
    num_rows = 0 if bitmask is None else len(bitmask)
    for request in with_drafts:
        so_request = request.structured_output_request
        grammar = so_request.grammar if so_request is not None else None
        if grammar is None or grammar.is_terminated() or not manager.should_fill_bitmask(request):
            continue
        masks = manager.bitmasks_along(grammar, spec_tokens[request.request_id])
        rows[request.request_id] = num_rows
        parts.append(masks)
        num_rows += len(masks)
    if not parts:
        return None, {}
    return (parts[0] if len(parts) == 1 else np.concatenate(parts)), rows
