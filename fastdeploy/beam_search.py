"""Beam search on top of ordinary generation, as vLLM does it.

Each step asks the engine for one token per live beam with ``2 * beam_width``
logprobs (prefix caching makes the repeated prompts cheap), extends every beam
by each candidate, and keeps the ``beam_width`` best by length-normalised score.
Beams that emit EOS are set aside as completed. The search itself
(:class:`BeamSearch`) does not run the model, so the offline ``LLM.beam_search``
and the server (:func:`beam_search_async`, for ``use_beam_search``) share it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    RequestOutput,
    get_beam_search_score,
)
from fastdeploy.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = [
    "BeamSearch",
    "BeamSearchInstance",
    "beam_search_async",
    "beam_search_params_from_request",
    "create_sort_beams_key_function",
]


def create_sort_beams_key_function(eos_token_id: int | None, length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    """The ranking key of beams: their length-normalised score (higher is better)."""

    def key(beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_id, length_penalty)

    return key


@dataclass
class BeamSearchInstance:
    """The search state of one prompt: its live beams and the ones that ended with EOS."""

    prompt_token_ids: list[int]
    prompt: str | None = None
    beams: list[BeamSearchSequence] = field(default_factory=list)
    completed: list[BeamSearchSequence] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.beams:
            self.beams = [BeamSearchSequence(tokens=list(self.prompt_token_ids))]


class BeamSearch:
    """The beam search over several prompts, one engine round trip per :meth:`advance`.

    Args:
        params: beam width, token budget, EOS handling, temperature and length penalty.
        eos_token_id: the model's EOS id (a beam that emits it is complete unless ``ignore_eos``).
        prompts: ``(prompt token ids, prompt text or None)`` per prompt.
    """

    def __init__(
        self, params: BeamSearchParams, eos_token_id: int | None, prompts: Sequence[tuple[list[int], str | None]]
    ) -> None:
        if params.structured_outputs is not None:
            raise ValueError("Structured outputs are not supported with beam search.")
        self.params = params
        self.eos_token_id = eos_token_id
        self.instances = [BeamSearchInstance(list(ids), text) for ids, text in prompts]
        self.sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)
        self.steps_done = 0

    @property
    def step_sampling_params(self) -> SamplingParams:
        """What each beam's one-token request asks the engine for."""
        return SamplingParams(
            logprobs=2 * self.params.beam_width,
            max_tokens=1,
            temperature=self.params.temperature,
            ignore_eos=True,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def live_beams(self) -> list[BeamSearchSequence]:
        """The beams to extend next, all prompts together (empty once the search is over)."""
        if self.steps_done >= self.params.max_tokens:
            return []
        return [beam for instance in self.instances for beam in instance.beams]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """Extend the live beams with their one-token outputs (in :meth:`live_beams` order)."""
        results = iter(outputs)
        for instance in self.instances:
            candidates: list[BeamSearchSequence] = []
            for beam in instance.beams:
                completion = next(results).outputs[0]
                if not completion.logprobs:
                    continue
                step_logprobs = completion.logprobs[0]
                for token_id, logprob in step_logprobs.items():
                    child = BeamSearchSequence(
                        tokens=[*beam.tokens, token_id],
                        logprobs=[*beam.logprobs, step_logprobs],
                        cum_logprob=beam.cum_logprob + logprob.logprob,
                    )
                    if token_id == self.eos_token_id and not self.params.ignore_eos:
                        child.finish_reason = "stop"
                        instance.completed.append(child)
                    else:
                        candidates.append(child)
            instance.beams = sorted(candidates, key=self.sort_key, reverse=True)[: self.params.beam_width]
        self.steps_done += 1

    def best_beams(self) -> list[list[BeamSearchSequence]]:
        """Per prompt, the ``beam_width`` best of its completed and live beams, best first."""
        best = []
        for instance in self.instances:
            for beam in instance.beams:
                beam.finish_reason = beam.finish_reason or "length"
            ranked = sorted([*instance.completed, *instance.beams], key=self.sort_key, reverse=True)
            best.append(ranked[: self.params.beam_width])
        return best

    def outputs(self, tokenizer: Any) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` result: beams whose ``tokens`` and ``text`` include the prompt."""
        results = []
        for beams in self.best_beams():
            if tokenizer is not None:
                for beam in beams:
                    beam.text = tokenizer.decode(beam.tokens)
            results.append(BeamSearchOutput(sequences=beams))
        return results

    def request_output(self, request_id: str, tokenizer: Any, index: int = 0) -> RequestOutput:
        """One prompt's result as a finished ``RequestOutput``: one completion per beam, generated part only."""
        instance = self.instances[index]
        prompt_len = len(instance.prompt_token_ids)
        completions = []
        for i, beam in enumerate(self.best_beams()[index]):
            token_ids = beam.tokens[prompt_len:]
            ended_by_eos = beam.finish_reason == "stop"
            shown = token_ids[:-1] if ended_by_eos and not self.params.include_stop_str_in_output else token_ids
            text = tokenizer.decode(shown, skip_special_tokens=True) if tokenizer is not None else ""
            completions.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=beam.cum_logprob,
                    logprobs=beam.logprobs,
                    finish_reason=beam.finish_reason,
                    stop_reason=None,
                )
            )
        return RequestOutput(
            request_id=request_id,
            prompt=instance.prompt,
            prompt_token_ids=instance.prompt_token_ids,
            prompt_logprobs=None,
            outputs=completions,
            finished=True,
        )


GenerateFn = Callable[..., AsyncIterator[RequestOutput]]


async def beam_search_async(
    generate: GenerateFn,
    prompt_token_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    *,
    eos_token_id: int | None,
    tokenizer: Any = None,
    prompt: str | None = None,
) -> RequestOutput:
    """Beam search of one prompt through an async engine (the server's ``use_beam_search``).

    Args:
        generate: ``AsyncLLM.generate``-like: ``generate(prompt, sampling_params, request_id)``
            yielding ``RequestOutput``s; the beams of a step run concurrently.
        prompt_token_ids: the tokenized prompt.
        params: the beam search parameters (see :func:`beam_search_params_from_request`).
        request_id: id of the request; each beam's step request gets a derived id.
        eos_token_id: the model's EOS id.
        tokenizer: to decode the beams' text (None: empty text).
        prompt: the prompt text, echoed in the result.

    Returns:
        One finished ``RequestOutput`` with a completion per beam, best first.
    """
    search = BeamSearch(params, eos_token_id, [(prompt_token_ids, prompt)])
    step_params = search.step_sampling_params
    counter = itertools.count()

    async def run_one(tokens: list[int]) -> RequestOutput:
        final = None
        async for output in generate({"prompt_token_ids": tokens}, step_params, f"{request_id}-beam-{next(counter)}"):
            final = output
        assert final is not None
        return final

    while beams := search.live_beams():
        search.advance(await asyncio.gather(*(run_one(beam.tokens) for beam in beams)))
    return search.request_output(request_id, tokenizer)


def beam_search_params_from_request(
    request: Any, max_tokens: int, default_sampling_params: Mapping[str, Any] | None = None
) -> BeamSearchParams:
    """vLLM's mapping of a completion/chat request with ``use_beam_search`` to ``BeamSearchParams``.

    ``n`` is the beam width; an unset temperature takes the model's default (else 1.0);
    ``length_penalty`` defaults to 1.0.
    """

    def field_of(name: str, default: Any = None) -> Any:
        value = request.get(name) if isinstance(request, Mapping) else getattr(request, name, None)
        return default if value is None else value

    temperature = field_of("temperature")
    if temperature is None:
        temperature = (default_sampling_params or {}).get("temperature", 1.0)
    return BeamSearchParams(
        beam_width=field_of("n", 1),
        max_tokens=max_tokens,
        ignore_eos=bool(field_of("ignore_eos", False)),
        temperature=temperature,
        length_penalty=float(field_of("length_penalty", 1.0)),
        include_stop_str_in_output=bool(field_of("include_stop_str_in_output", False)),
    )
