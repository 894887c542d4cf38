"""Requests as the engine core sees them, and the messages that cross its boundary.

``EngineCoreRequest`` / ``EngineCoreOutputs`` are msgspec structs so the same
objects travel in-process (``LLM``) and over ZMQ (the API server).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any

import msgspec

from fastdeploy.multimodal.inputs import MultiModalFeatureSpec
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.spec_decode.scheduling import SpecDecodingStats

if TYPE_CHECKING:
    from fastdeploy.model_executor.guided_decoding.request import StructuredOutputRequest


class FinishReason(enum.IntEnum):
    """Why a request finished; ``str()`` gives the OpenAI spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized request handed to the engine core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    # Bad-word sequences, already tokenized by the front end.
    bad_words_token_ids: list[list[int]] | None = None
    # Images of the prompt, processed by the front end (placeholders already expanded).
    mm_features: list[MultiModalFeatureSpec] | None = None


class LogprobsLists(msgspec.Struct, array_like=True):
    """Top-k logprobs of a run of positions: row i holds the chosen token first, then the top-k."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the chosen token in each row
    # Rank of every entry of each row, when the entries after the chosen token are not the top-k
    # in order (vLLM's logprob_token_ids); None: they rank 1..k by position.
    entry_ranks: list[list[int]] | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Disaggregated serving: what the prefill side hands to the decode side (vLLM's field).
    kv_transfer_params: dict[str, Any] | None = None
    # Set when the request failed inside a running engine (KV transfer, global scheduler):
    # the front end raises it to this request's caller alone.
    error: str | None = None
    # Times the request was preempted so far (vllm:request_num_preemptions); 0 is not sent.
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """Scheduler figures sent with each step for /metrics and logging."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    # Of the waiting requests, those waiting for something other than room in the batch (their KV
    # cache from a prefill instance): vllm:num_requests_waiting_by_reason{reason="deferred"}.
    num_deferred_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_used_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding: the drafts verified since the last stats (None: none, or no speculation).
    spec_decoding_stats: SpecDecodingStats | None = None
    # KV-transfer events since the last stats: ("ok", direction, protocol, bytes, blocks, seconds)
    # or ("failed", direction, protocol, 0, 0, 0.0).
    kv_transfer_events: list[tuple[str, str, str, int, int, float]] = []
    # --scheduler-name global: requests this engine took from the shared queue since the last
    # stats, submitted to this instance (own) or stolen from another instance's queue.
    num_global_own_reqs: int = 0
    num_global_stolen_reqs: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """All outputs of one engine step."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    # The data-parallel engine that produced them (set by the API process's client on receipt).
    engine_index: int = 0


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Waiting for its structured-output grammar to compile; not schedulable yet.
    WAITING_FOR_FSM = 1
    # Disaggregated decode: blocks allocated, the prompt's KV cache still on its way.
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7

    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    def finish_reason(self) -> FinishReason | None:
        return {
            RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
            RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
            RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        }.get(self)


class Request:
    """Engine-side state of one request: its tokens, progress and KV bookkeeping."""

    def __init__(self, core_req: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = core_req.request_id
        self.sampling_params = core_req.sampling_params
        self.eos_token_id = core_req.eos_token_id
        self.arrival_time = core_req.arrival_time or time.time()
        self.priority = core_req.priority
        self.bad_words_token_ids = core_req.bad_words_token_ids
        self.mm_features = core_req.mm_features
        self.prompt_token_ids = list(core_req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0
        # -1 until the first scheduling decides the prefix-cache hit.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Hashes of the full blocks of all_token_ids, extended as tokens arrive.
        self.block_hashes: list[int] = []
        # Prompt logprob rows already sent (positions 0..n-1): a run after a preemption skips them.
        self.num_prompt_logprobs_sent = 0
        # Rows a prefix-cache hit supplied, sent with the request's next step output.
        self.cached_prompt_logprobs: LogprobsLists | None = None
        # Speculative decoding: drafts for the next step (validated; verified by the target then).
        self.spec_token_ids: list[int] = []
        sp = self.sampling_params
        left = max_model_len - self.num_prompt_tokens
        self.max_tokens = left if sp.max_tokens is None else min(sp.max_tokens, left)
        self.stop_token_ids = frozenset(sp.stop_token_ids or ())
        # Set by the StructuredOutputManager when the request carries a constraint.
        self.structured_output_request: StructuredOutputRequest | None = None
        # Disaggregated serving (vLLM's ``kv_transfer_params``, carried in sampling_params.extra_args).
        self.kv_transfer_params: dict[str, Any] | None = (sp.extra_args or {}).get("kv_transfer_params") or None
        params = self.kv_transfer_params or {}
        # Prefill half: keep the KV blocks after the first token and hand them to a decode instance.
        self.do_remote_decode = bool(params.get("do_remote_decode"))
        # Decode half: the prompt's KV comes from a prefill instance; cleared once it has arrived.
        self.do_remote_prefill = bool(params.get("do_remote_prefill"))
        if self.do_remote_decode:
            # The prefill half ends at its first token, whatever max_tokens said.
            self.max_tokens = min(self.max_tokens, 1)

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status.is_finished()

    def get_finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason()

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
