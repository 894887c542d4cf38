"""Prompt types accepted by ``LLM.generate`` (vLLM's ``TextPrompt`` / ``TokensPrompt``)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    """A prompt given as text."""

    prompt: str
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any]]


class TokensPrompt(TypedDict):
    """A prompt given as token ids (``prompt`` is the optional text it came from)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    multi_modal_data: NotRequired[Any]


PromptType = Union[str, TextPrompt, TokensPrompt]
