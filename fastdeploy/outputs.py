"""Results returned by ``LLM.generate`` / the engines, shaped like vLLM's ``vllm.outputs``.

One difference is additive: ``RequestOutput.outputs`` is a :class:`CompletionOutputList`,
a ``list`` that also answers attribute reads with its first completion's fields, so
FastDeploy's older ``output.outputs.text`` keeps working next to vLLM's
``output.outputs[0].text``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, MutableSequence
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.logger import init_logger
from fastdeploy.logprobs import Logprob, PromptLogprobs, SampleLogprobs

logger = init_logger(__name__)

__all__ = [
    "BeamSearchOutput",
    "BeamSearchSequence",
    "CompletionOutput",
    "CompletionOutputList",
    "RequestMetrics",
    "RequestOutput",
    "get_beam_search_score",
]


@dataclass
class CompletionOutput:
    """One completion of a request.

    Args:
        index: Position of this completion among the request's ``n``.
        text: Generated text (the delta only, for ``RequestOutputKind.DELTA``).
        token_ids: Generated token ids.
        cumulative_logprob: Sum of the generated tokens' logprobs, when computed.
        logprobs: Per generated token, ``{token_id: Logprob}`` of the chosen and top tokens.
        finish_reason: ``"stop"``, ``"length"`` or ``"abort"``; ``None`` while running.
        stop_reason: The stop string or stop token id that ended it; ``None`` for EOS
            or any other reason.
        kv_transfer_params: Parameters for remote KV-cache transfer (disaggregated serving).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def finished(self) -> bool:
        """Whether this completion has ended."""
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, "
            f"text={self.text!r}, "
            f"token_ids={self.token_ids}, "
            f"cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, "
            f"finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


class CompletionOutputList(list):
    """The completions of a request: a plain ``list`` of :class:`CompletionOutput`.

    Reading or writing an attribute the list itself lacks (``.text``,
    ``.token_ids``, ``.finish_reason``, ...) goes to the first completion, which
    keeps FastDeploy's former single-output form ``output.outputs.text`` working.
    List methods win: ``outputs.index`` is ``list.index``, so read the completion
    index as ``outputs[0].index``.
    """

    # No instance __dict__: every unknown attribute must reach the first completion.
    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        # Dunder lookups (pickle, copy, IPython) must fail normally, not be forwarded.
        if name.startswith("__") or not self:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("__") or hasattr(list, name) or not self:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        setattr(self[0], name, value)


@dataclass
class RequestMetrics:
    """Timestamps (``time.time()`` seconds) and counts of one request's life.

    The engine fills these in; the server's Prometheus metrics and the
    benchmarks read them.
    """

    arrival_time: float = field(default_factory=time.time)
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    def record_scheduled(self, now: float | None = None) -> None:
        """Note the first time the request is scheduled (later calls are ignored)."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.time() if now is None else now
            self.time_in_queue = self.first_scheduled_time - self.arrival_time

    def record_tokens(self, num_tokens: int = 1, now: float | None = None) -> None:
        """Note ``num_tokens`` newly generated tokens."""
        now = time.time() if now is None else now
        if self.first_token_time is None and num_tokens > 0:
            self.first_token_time = now
        self.last_token_time = now
        self.num_generation_tokens += num_tokens

    def record_finished(self, now: float | None = None) -> None:
        """Note the time the request finished."""
        self.finished_time = time.time() if now is None else now

    @property
    def first_token_latency(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        """Arrival to finish."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between generated tokens after the first (TPOT)."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


class RequestOutput:
    """The output of one request to the engine or ``LLM`` (vLLM's ``RequestOutput``).

    Args:
        request_id: The request's unique id.
        prompt: The prompt text, when known.
        prompt_token_ids: The prompt's token ids.
        prompt_logprobs: Per prompt token ``{token_id: Logprob}``; the first entry is ``None``.
        outputs: The completions; stored as a :class:`CompletionOutputList`.
        finished: Whether the whole request has ended.
        metrics: Timing of the request.
        lora_request: The LoRA adapter used, if any.
        encoder_prompt: Encoder prompt of encoder-decoder models.
        encoder_prompt_token_ids: Its token ids.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        kv_transfer_params: Remote KV-transfer parameters; when not given, taken
            from the completions.
        **kwargs: Ignored with a warning, as vLLM does, so newer callers still run.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: Iterable[CompletionOutput],
        finished: bool,
        metrics: RequestMetrics | None = None,
        lora_request: Any = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            logger.warning("RequestOutput: Ignoring extra arguments: %s", kwargs)
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs  # type: ignore[assignment]
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self._kv_transfer_params = kv_transfer_params

    @property
    def outputs(self) -> CompletionOutputList:
        """The completions, indexable (``[0].text``) and, legacy, ``.text`` directly."""
        return self._outputs

    @outputs.setter
    def outputs(self, value: Iterable[CompletionOutput]) -> None:
        # Wrap on every assignment so the legacy attribute access survives reassignment.
        self._outputs = value if isinstance(value, CompletionOutputList) else CompletionOutputList(value)

    @property
    def kv_transfer_params(self) -> dict[str, Any] | list[dict[str, Any]] | None:
        """Remote KV-transfer parameters: as given, else those of the completions
        (one dict for one completion, a list for several)."""
        if self._kv_transfer_params is not None:
            return self._kv_transfer_params
        params = [o.kv_transfer_params for o in self._outputs if o.kv_transfer_params]
        if not params:
            return None
        return params[0] if len(params) == 1 else params

    @kv_transfer_params.setter
    def kv_transfer_params(self, value: dict[str, Any] | None) -> None:
        self._kv_transfer_params = value

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output of the same request into this one.

        With ``aggregate`` the completions' deltas are appended (text, token ids,
        logprobs); otherwise each completion is replaced by its newer version.
        """
        self.finished |= next_output.finished
        if next_output.metrics is not None:
            self.metrics = next_output.metrics
        if next_output.num_cached_tokens is not None:
            self.num_cached_tokens = next_output.num_cached_tokens
        for nxt in next_output.outputs:
            for i, cur in enumerate(self._outputs):
                if cur.index != nxt.index:
                    continue
                if aggregate:
                    cur.text += nxt.text
                    if not isinstance(cur.token_ids, MutableSequence):
                        cur.token_ids = list(cur.token_ids)
                    cur.token_ids.extend(nxt.token_ids)
                    if nxt.logprobs:
                        if cur.logprobs is None:
                            cur.logprobs = []
                        cur.logprobs.extend(nxt.logprobs)
                    cur.cumulative_logprob = nxt.cumulative_logprob
                    cur.finish_reason = nxt.finish_reason
                    cur.stop_reason = nxt.stop_reason
                    cur.kv_transfer_params = nxt.kv_transfer_params
                else:
                    self._outputs[i] = nxt
                break
            else:
                self._outputs.append(nxt)

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, "
            f"prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"encoder_prompt={self.encoder_prompt!r}, "
            f"encoder_prompt_token_ids={self.encoder_prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, "
            f"outputs={list(self._outputs)}, "
            f"finished={self.finished}, "
            f"metrics={self.metrics}, "
            f"lora_request={self.lora_request}, "
            f"num_cached_tokens={self.num_cached_tokens}, "
            f"kv_transfer_params={self.kv_transfer_params})"
        )


@dataclass
class BeamSearchSequence:
    """One beam: all its tokens (prompt included) and running score.

    Args:
        tokens: Prompt plus generated token ids.
        logprobs: Per generated token, ``{token_id: Logprob}``.
        cum_logprob: Sum of the generated tokens' logprobs.
        text: Decoded text, once finished.
        finish_reason: Why the beam ended, once finished.
        stop_reason: The stop string or token id that ended it.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beams returned for one prompt by ``LLM.beam_search``, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int],
    cumulative_logprob: float,
    eos_token_id: int | None,
    length_penalty: float = 1.0,
) -> float:
    """Length-normalised beam score: ``cumulative_logprob / len ** length_penalty``.

    A trailing EOS is not counted in the length, as in vLLM / Hugging Face.
    """
    seq_len = len(tokens)
    if tokens and eos_token_id is not None and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)
