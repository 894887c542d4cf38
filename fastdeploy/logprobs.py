"""Log-probability containers shared by the engine, ``LLM`` and the OpenAI server.

The shapes match vLLM's ``vllm.logprobs`` so code that walks
``output.outputs[0].logprobs`` (a list of ``{token_id: Logprob}`` dicts) or
``output.prompt_logprobs`` (the same, with ``None`` for the first prompt token)
runs unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "Logprob",
    "PromptLogprobs",
    "SampleLogprobs",
    "append_logprobs_for_next_position",
    "create_prompt_logprobs",
    "create_sample_logprobs",
]


@dataclass
class Logprob:
    """The log probability of one token at one position.

    Attributes:
        logprob: Natural-log probability of the token.
        rank: 1-based rank of the token in the vocabulary at this position
            (1 = most likely); ``None`` when it was not computed.
        decoded_token: The token's text, when detokenisation was requested.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token; the first is None because nothing precedes it.
PromptLogprobs = list[dict[int, Logprob] | None]
# One entry per generated token.
SampleLogprobs = list[dict[int, Logprob]]


def create_prompt_logprobs() -> PromptLogprobs:
    """An empty prompt-logprobs list, already holding the ``None`` of the first token."""
    return [None]


def create_sample_logprobs() -> SampleLogprobs:
    """An empty sample-logprobs list."""
    return []


def append_logprobs_for_next_position(
    request_logprobs: PromptLogprobs | SampleLogprobs,
    token_ids: list[int],
    logprobs: list[float],
    decoded_tokens: Iterable[str | None] | None,
    rank: int | None,
    num_logprobs: int,
) -> None:
    """Append one position's logprobs to ``request_logprobs``.

    Args:
        request_logprobs: The list being built for a request.
        token_ids: The chosen (sampled or prompt) token first, then the top-k tokens.
        logprobs: Log probabilities aligned with ``token_ids``.
        decoded_tokens: Texts aligned with ``token_ids``, or ``None`` when not detokenising.
        rank: Vocabulary rank of the chosen token.
        num_logprobs: How many top-k entries were requested; ``-1`` means all given.
    """
    if num_logprobs == -1:
        num_logprobs = len(logprobs) - 1
    texts = list(decoded_tokens) if decoded_tokens is not None else [None] * len(token_ids)
    # The chosen token carries its true rank; the top-k that follow are ranked
    # 1..k by construction. dict insertion keeps the chosen token first, and a
    # top-k entry equal to the chosen token does not overwrite its rank.
    position: dict[int, Logprob] = {token_ids[0]: Logprob(logprobs[0], rank, texts[0])}
    for k, (tid, lp, text) in enumerate(
        zip(token_ids[1 : num_logprobs + 1], logprobs[1 : num_logprobs + 1], texts[1 : num_logprobs + 1], strict=False),
        start=1,
    ):
        position.setdefault(tid, Logprob(lp, k, text))
    request_logprobs.append(position)
