"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fastdeploy.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or is resuming after preemption): all of its state."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    bad_words_token_ids: list[list[int]] | None = None
    eos_token_id: int | None = None
    # Images of the prompt (fastdeploy.multimodal.inputs.MultiModalFeatureSpec).
    mm_features: list | None = None


@dataclass
class CachedRequestData:
    """A request already in the runner's batch: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # Tokens to compute this step, per request, in scheduling order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must drop (finished, aborted or preempted) before this step.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: allowed-token bitmask [k, ceil(vocab / 32)] int32 of the constrained
    # requests sampled this step, and each one's row in it.
    grammar_bitmask: np.ndarray | None = None
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: the drafts each request verifies this step (counted in its scheduled
    # tokens). A constrained request with drafts has len(drafts) + 1 consecutive bitmask rows,
    # from its structured_output_request_ids row on: one per verified position.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)

    def grammar_rows(self, sampled_req_ids: list[str]) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The bitmask rows of the constrained requests among ``sampled_req_ids`` and their positions there.

        Returns ``(bitmask [m, words], positions [m])`` so that ``bitmask[i]`` applies to sampled row
        ``positions[i]``; ``(None, None)`` when none of them is constrained.
        """
        if self.grammar_bitmask is None:
            return None, None
        pairs = [
            (self.structured_output_request_ids[r], j)
            for j, r in enumerate(sampled_req_ids)
            if r in self.structured_output_request_ids
        ]
        if not pairs:
            return None, None
        mask_rows, positions = zip(*pairs, strict=True)
        return self.grammar_bitmask[list(mask_rows)], np.asarray(positions, dtype=np.int64)
