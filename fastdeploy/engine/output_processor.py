"""Turns engine-core outputs into ``RequestOutput``s: text, stop strings, logprobs, n > 1.

Runs in the front end (the ``LLM`` process or the API server), so the engine
loop never waits on text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from fastdeploy.engine.detokenizer import IncrementalDetokenizer, TokenStringCache
from fastdeploy.engine.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    LogprobsLists,
)
from fastdeploy.logprobs import Logprob, PromptLogprobs, SampleLogprobs
from fastdeploy.outputs import CompletionOutput, RequestMetrics, RequestOutput
from fastdeploy.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from fastdeploy.engine.processor import ProcessedRequest


@dataclass
class ParentRequest:
    """A request with n > 1, fanned out into n child requests in the engine."""

    request_id: str
    n: int
    output_kind: RequestOutputKind
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0

    @staticmethod
    def child_id(index: int, request_id: str) -> str:
        return f"{index}_{request_id}"

    @staticmethod
    def child_sampling_params(sp: SamplingParams, index: int) -> SamplingParams:
        """Children sample independently: each gets n=1 and, when seeded, its own seed."""
        child = sp.clone()
        child.n = 1
        if sp.seed is not None:
            child.seed = sp.seed + index
        return child


class ProcessedOutputs(NamedTuple):
    """What one step's engine outputs became in the front end."""

    request_outputs: list[RequestOutput]
    # Engine requests to abort in the core (a stop string ended them here).
    to_abort: list[str]
    # Caller request id -> error, for requests that failed inside the engine.
    failed: dict[str, str]


class RequestState:
    """Front-end state of one engine request (a child when n > 1)."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sp: SamplingParams,
        tokenizer,
        token_strings: TokenStringCache | None,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.sp = sp
        self.parent = parent
        self.index = index
        self.output_kind = sp.output_kind
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_token_ids, sp.skip_special_tokens)
            if tokenizer is not None and sp.detokenize
            else None
        )
        self.token_strings = token_strings
        self.stop = list(sp.stop or ())
        # While streaming, hold back text that could still grow into a stop string.
        self.stop_buffer = max((len(s) for s in self.stop), default=1) - 1 if not sp.include_stop_str_in_output else 0
        self.token_ids: list[int] = []
        self.text = ""
        self.sent_text_len = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.logprobs: SampleLogprobs | None = [] if sp.num_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if sp.num_logprobs is not None else None
        self.prompt_logprobs: PromptLogprobs | None = [None] if sp.prompt_logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _logprob_dicts(self, lists: LogprobsLists) -> list[dict[int, Logprob]]:
        out = []
        entry_ranks = lists.entry_ranks or [None] * len(lists.ranks)
        for ids, lps, rank, ranks in zip(lists.token_ids, lists.logprobs, lists.ranks, entry_ranks, strict=True):
            texts = self.token_strings(ids) if self.token_strings is not None else [None] * len(ids)
            entry: dict[int, Logprob] = {ids[0]: Logprob(lps[0], rank, texts[0])}
            for r, (tid, lp, text) in enumerate(zip(ids[1:], lps[1:], texts[1:], strict=True), start=1):
                entry.setdefault(tid, Logprob(lp, r if ranks is None else ranks[r], text))
            out.append(entry)
        return out

    def update(self, eco: EngineCoreOutput) -> bool:
        """Apply one step's output; returns True when a stop string ended the request here."""
        now = time.time()
        if eco.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(self._logprob_dicts(eco.new_prompt_logprobs))
        if not eco.new_token_ids and not eco.finished:
            return False
        if self.metrics.first_token_time is None and eco.new_token_ids:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.num_preemptions = eco.num_preemptions
        self.num_cached_tokens = eco.num_cached_tokens
        if eco.kv_transfer_params is not None:
            self.kv_transfer_params = eco.kv_transfer_params
        self.token_ids.extend(eco.new_token_ids)
        if eco.new_logprobs is not None and self.logprobs is not None:
            dicts = self._logprob_dicts(eco.new_logprobs)
            self.logprobs.extend(dicts)
            self.cumulative_logprob += sum(lp[0] for lp in eco.new_logprobs.logprobs)
        stopped_by_string = False
        if self.detokenizer is not None:
            prev_len = len(self.text)
            self.text += self.detokenizer.update(eco.new_token_ids)
            if self.stop and len(self.token_ids) > self.sp.min_tokens:
                stopped_by_string = self._check_stop_strings(prev_len)
        if not stopped_by_string and eco.finished:
            self.finish_reason = str(eco.finish_reason)
            self.stop_reason = eco.stop_reason
        if self.finished:
            self.metrics.finished_time = now
        return stopped_by_string

    def _check_stop_strings(self, prev_len: int) -> bool:
        longest = max(len(s) for s in self.stop)
        search_from = max(0, prev_len - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.sp.include_stop_str_in_output else self.text[:i]
        self.finish_reason = str(FinishReason.STOP)
        self.stop_reason = s
        return True

    def make_completion(self) -> CompletionOutput:
        """The completion to report now, shaped by the output kind."""
        delta = self.output_kind == RequestOutputKind.DELTA
        text_end = len(self.text) if self.finished else max(self.sent_text_len, len(self.text) - self.stop_buffer)
        text = self.text[self.sent_text_len : text_end] if delta else self.text[:text_end]
        token_ids = self.token_ids[self.sent_tokens :] if delta else list(self.token_ids)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self.sent_logprobs :] if delta else list(self.logprobs)
        if delta:
            self.sent_text_len, self.sent_tokens = text_end, len(self.token_ids)
            self.sent_logprobs = len(self.logprobs or ())
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class OutputProcessor:
    """Tracks every in-flight request of the front end and builds its outputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_strings = TokenStringCache(tokenizer) if tokenizer is not None else None
        self.request_states: dict[str, RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sp: SamplingParams,
        arrival_time: float,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        if request_id in self.request_states:
            raise ValueError(f"Request id {request_id} already running.")
        self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, sp, self.tokenizer, self.token_strings, arrival_time, parent, index
        )
        if parent is not None:
            self.parents[parent.request_id] = parent

    def add_processed_request(self, processed: ProcessedRequest) -> list[EngineCoreRequest]:
        """Track every engine request of ``processed``; returns them, for the engine core."""
        prompt = processed.prompt
        for spec in processed.engine_requests:
            core = spec.core_request
            self.add_request(core.request_id, prompt.text, prompt.token_ids, core.sampling_params,
                             processed.arrival_time, spec.parent, spec.index)
        return [spec.core_request for spec in processed.engine_requests]

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget requests (and their children); returns the engine ids to abort."""
        engine_ids = []
        for req_id in request_ids:
            parent = self.parents.pop(req_id, None)
            ids = [ParentRequest.child_id(i, req_id) for i in range(parent.n)] if parent else [req_id]
            for rid in ids:
                if self.request_states.pop(rid, None) is not None:
                    engine_ids.append(rid)
        return engine_ids

    def process_outputs(self, engine_outputs: EngineCoreOutputs) -> ProcessedOutputs:
        """Apply a step's outputs: the RequestOutputs to hand out, the ids to abort, the failures."""
        request_outputs: list[RequestOutput] = []
        to_abort: list[str] = []
        failed: dict[str, str] = {}
        for eco in engine_outputs.outputs:
            state = self.request_states.get(eco.request_id)
            if state is None:  # aborted meanwhile
                continue
            if eco.error is not None:
                # The whole request fails (all of its n children): its caller gets the error.
                caller_id = state.parent.request_id if state.parent is not None else eco.request_id
                failed[caller_id] = eco.error
                to_abort.extend(rid for rid in self.abort_requests([caller_id]) if rid != eco.request_id)
                continue
            if state.update(eco):
                to_abort.append(eco.request_id)
            out = self._make_request_output(state)
            if state.finished:
                del self.request_states[eco.request_id]
            if out is not None:
                request_outputs.append(out)
        return ProcessedOutputs(request_outputs, to_abort, failed)

    def _make_request_output(self, state: RequestState) -> RequestOutput | None:
        if state.output_kind == RequestOutputKind.FINAL_ONLY and not state.finished:
            return None
        if (
            state.output_kind == RequestOutputKind.DELTA
            and not state.finished
            and state.prompt_logprobs is None
            and len(state.token_ids) == state.sent_tokens
        ):
            return None
        completion = state.make_completion()
        parent = state.parent
        if parent is None:
            return self._request_output(state, state.request_id, [completion], state.finished)
        parent.completions[state.index] = completion
        if state.finished:
            parent.num_finished += 1
        finished = parent.num_finished == parent.n
        if finished:
            self.parents.pop(parent.request_id, None)
        if parent.output_kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            completions = [parent.completions[i] for i in sorted(parent.completions)]
        elif parent.output_kind == RequestOutputKind.DELTA:
            completions = [completion]
        else:
            completions = [parent.completions[i] for i in sorted(parent.completions)]
        return self._request_output(state, parent.request_id, completions, finished)

    @staticmethod
    def _request_output(
        state: RequestState, request_id: str, completions: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
        )
