"""The reasoning parser interface and its registry (``--reasoning-parser``).

A parser splits a thinking model's output into ``reasoning`` (the thinking) and
``content`` (the answer). The HTTP layer calls, per request:

- ``extract_reasoning(model_output, request) -> (reasoning, content)`` on a finished output;
- ``extract_reasoning_streaming(previous_text, current_text, delta_text,
  previous_token_ids, current_token_ids, delta_token_ids) -> DeltaMessage | None``
  per chunk while ``is_reasoning_end(token_ids)`` is False, and streams the rest as content;
- ``is_reasoning_end(token_ids)``: whether these ids close the reasoning (also used by
  structured outputs, which constrain only the answer).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from fastdeploy.entrypoints.chat_deltas import DeltaMessage
from fastdeploy.entrypoints.parser_registry import ParserManager, ParserRegistry


class ReasoningParser(ABC):
    """Splits reasoning from content.

    Args:
        tokenizer: the model's tokenizer (parsers look their marker tokens up in it).
        chat_template_kwargs: the request's chat template arguments (e.g. ``enable_thinking``).
    """

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        self.model_tokenizer = tokenizer
        self.chat_template_kwargs: dict[str, Any] = dict(kwargs.get("chat_template_kwargs") or {})

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Token string -> id of the tokenizer."""
        from fastdeploy.transformers_utils.tokenizer import cached_vocab

        return cached_vocab(self.model_tokenizer)

    @abstractmethod
    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Whether the reasoning section is closed at the end of these ids."""

    @abstractmethod
    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        """The ids of the answer (after the reasoning)."""

    @abstractmethod
    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a complete output; either may be None."""

    @abstractmethod
    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """The reasoning/content split of the newest chunk (``None``: nothing to send)."""

    # vLLM's former method names, kept for callers written against them.
    def extract_reasoning_content(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        return self.extract_reasoning(model_output, request)

    def extract_reasoning_content_streaming(self, *args: Any, **kwargs: Any) -> DeltaMessage | None:
        return self.extract_reasoning_streaming(*args, **kwargs)


class ReasoningParserManager(ParserManager):
    """Registry of reasoning parsers by ``--reasoning-parser`` name (vLLM's classmethod API)."""

    registry: ParserRegistry[ReasoningParser] = ParserRegistry("reasoning", "reasoning_parsers")

    @classmethod
    def get_reasoning_parser(cls, name: str | None) -> type[ReasoningParser]:
        """The parser class registered as ``name``; KeyError listing the known names otherwise."""
        return cls.registry.get(name)
