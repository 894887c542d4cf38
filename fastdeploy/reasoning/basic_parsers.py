"""Reasoning delimited by a start and an end token (``<think>...</think>``)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from fastdeploy.entrypoints.chat_deltas import DeltaMessage
from fastdeploy.reasoning.abs_reasoning_parsers import ReasoningParser


def split_at(text: str, marker: str) -> tuple[str, str]:
    """``text`` before and after the first ``marker`` (which must occur)."""
    before, _, after = text.partition(marker)
    return before, after


class BaseThinkingReasoningParser(ReasoningParser):
    """Reasoning between ``start_token`` and ``end_token``, both single tokens of the vocabulary.

    The start token may be missing from the output (templates that put it in
    the prompt): text before the end token is then reasoning.
    """

    @property
    @abstractmethod
    def start_token(self) -> str:
        """The token opening the reasoning."""

    @property
    @abstractmethod
    def end_token(self) -> str:
        """The token closing the reasoning."""

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        if not self.model_tokenizer:
            raise ValueError("The model tokenizer must be passed to the ReasoningParser constructor.")
        self.start_token_id = self.vocab.get(self.start_token)
        self.end_token_id = self.vocab.get(self.end_token)
        missing = [t for t, i in ((self.start_token, self.start_token_id), (self.end_token, self.end_token_id))
                   if i is None]
        if missing:
            raise ValueError(f"{type(self).__name__} needs the tokens {self.start_token!r} and {self.end_token!r}, "
                             f"but this model's vocabulary has no {' or '.join(map(repr, missing))}: the model does "
                             "not mark its reasoning with them. Choose another --reasoning-parser, or none.")

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        # The latest marker decides: a start after an end reopens the reasoning.
        for token in reversed(input_ids):
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
        return False

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self.end_token_id not in input_ids[:-1]:
            return []
        return input_ids[input_ids.index(self.end_token_id) + 1 :]

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if self.start_token in model_output:
            model_output = split_at(model_output, self.start_token)[1]
        if self.end_token not in model_output:
            # Cut off while thinking: all of it is reasoning.
            return model_output, None
        reasoning, content = split_at(model_output, self.end_token)
        return reasoning, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if len(delta_token_ids) == 1 and delta_token_ids[0] in (self.start_token_id, self.end_token_id):
            return None  # a bare marker carries no text
        if self.start_token_id in previous_token_ids:
            return self._after_start(previous_token_ids, delta_text, delta_token_ids)
        if self.start_token_id in delta_token_ids:
            delta_text = split_at(delta_text, self.start_token)[1]
            if self.end_token_id in delta_token_ids:
                reasoning, content = split_at(delta_text, self.end_token)
                return DeltaMessage(reasoning=reasoning, content=content or None)
            return DeltaMessage(reasoning=delta_text)
        return self._without_start(previous_token_ids, delta_text, delta_token_ids)

    def _after_start(
        self, previous_token_ids: Sequence[int], delta_text: str, delta_token_ids: Sequence[int]
    ) -> DeltaMessage:
        """A chunk of an output whose reasoning has opened."""
        if self.end_token_id in delta_token_ids:
            reasoning, content = split_at(delta_text, self.end_token)
            return DeltaMessage(reasoning=reasoning, content=content or None)
        if self.end_token_id in previous_token_ids:
            return DeltaMessage(content=delta_text)
        return DeltaMessage(reasoning=delta_text)

    def _without_start(
        self, previous_token_ids: Sequence[int], delta_text: str, delta_token_ids: Sequence[int]
    ) -> DeltaMessage | None:
        """A chunk of an output with no start token so far: plain content (model not thinking)."""
        return DeltaMessage(content=delta_text)


class ThinkTagReasoningParser(BaseThinkingReasoningParser):
    """The common ``<think>`` ... ``</think>`` markers."""

    @property
    def start_token(self) -> str:
        return "<think>"

    @property
    def end_token(self) -> str:
        return "</think>"
