"""Per-step statistics gathered in the API process from the engine core's outputs.

Timing of a request (vLLM's definitions): queued = arrival -> first scheduled,
prefill = first scheduled -> first token, decode = first token -> last token,
inference = first scheduled -> finish. The engine reports when each step started;
a request counts as scheduled at the start of the first step that produced an
output for it (with chunked prefill of a prompt longer than the token budget,
the earlier chunks are therefore counted as queue time).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastdeploy.engine.output_processor import RequestState
from fastdeploy.engine.request import EngineCoreOutput


@dataclass
class FinishedRequestStats:
    """Figures of one finished (or aborted) engine request."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    # The request's n (its parent's for a child of an n > 1 request) and its preemptions.
    n_param: int
    num_preemptions: int
    queued_time: float
    prefill_time: float
    inference_time: float
    decode_time: float


@dataclass
class IterationStats:
    """What one engine step (as seen by the API process) added to the counters and histograms."""

    iteration_timestamp: float = field(default_factory=time.time)
    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
    time_to_first_tokens_iter: list[float] = field(default_factory=list)
    inter_token_latencies_iter: list[float] = field(default_factory=list)

    def observe_output(self, output: EngineCoreOutput, state: RequestState, step_start: float) -> None:
        """Account one request's output of this step; call before the state is updated with it."""
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.record_scheduled(step_start)
        if not output.new_token_ids:
            return
        now = self.iteration_timestamp
        self.num_generation_tokens += len(output.new_token_ids)
        if metrics.first_token_time is None:
            self.num_prompt_tokens += len(state.prompt_token_ids)
            self.time_to_first_tokens_iter.append(now - metrics.arrival_time)
        elif metrics.last_token_time is not None:
            self.inter_token_latencies_iter.append(now - metrics.last_token_time)

    def observe_finished(self, state: RequestState, finish_reason: str) -> None:
        """Account a request that finished (or was aborted) in this step."""
        now = self.iteration_timestamp
        metrics = state.metrics
        scheduled = metrics.first_scheduled_time if metrics.first_scheduled_time is not None else now
        first_token = metrics.first_token_time if metrics.first_token_time is not None else now
        last_token = metrics.last_token_time if metrics.last_token_time is not None else first_token
        self.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - metrics.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(state.token_ids),
                max_tokens_param=state.sp.max_tokens,
                n_param=state.parent.n if state.parent is not None else state.sp.n,
                num_preemptions=metrics.num_preemptions,
                queued_time=scheduled - metrics.arrival_time,
                prefill_time=first_token - scheduled,
                inference_time=now - scheduled,
                decode_time=last_token - first_token,
            )
        )
