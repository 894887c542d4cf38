"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

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
