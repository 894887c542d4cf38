"""What one forward + sampling step returns to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy.engine.request import LogprobsLists


@dataclass
class ModelRunnerOutput:
    # Requests that sampled a token this step (partial prefill chunks do not).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Speculative decoding: each request's drafts for its next step (vLLM's draft_token_ids).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput()
