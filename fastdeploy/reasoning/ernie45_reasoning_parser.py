"""ERNIE 4.5 thinking: ``abc\\n</think>\\n\\n<response>\\ndef\\n</response>\\n`` or ``abc\\n</think>\\ndef``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastdeploy.entrypoints.chat_deltas import DeltaMessage
from fastdeploy.reasoning.abs_reasoning_parsers import ReasoningParserManager
from fastdeploy.reasoning.basic_parsers import ThinkTagReasoningParser, split_at


@ReasoningParserManager.register_module("ernie45")
class Ernie45ReasoningParser(ThinkTagReasoningParser):
    """Reasoning before ``</think>``; the answer, when wrapped in ``<response>`` tags, loses them."""

    response_start_token = "<response>"
    response_end_token = "</response>"

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self.response_start_token_id = self.vocab.get(self.response_start_token)
        self.response_end_token_id = self.vocab.get(self.response_end_token)
        self._markers = {
            self.start_token_id,
            self.end_token_id,
            self.response_start_token_id,
            self.response_end_token_id,
        } - {None}

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        reasoning, content = super().extract_reasoning(model_output, request)
        if content:
            start = content.find(self.response_start_token)
            end = content.rfind(self.response_end_token)
            if start != -1 and end != -1 and start < end:
                content = content[start + len(self.response_start_token) : end]
            else:
                # "abc</think>\ndef": the answer is "def" (the streamed split drops that newline too).
                content = content.lstrip("\n")
        return reasoning, content or None

    def _strip_response_tags(self, content: str, delta_token_ids: Sequence[int]) -> str:
        if self.response_start_token_id in delta_token_ids:
            content = split_at(content.lstrip("\n"), self.response_start_token)[1]
        end = content.rfind(self.response_end_token)
        if end != -1:
            content = content[:end]
        return content

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if len(delta_token_ids) == 1 and delta_token_ids[0] in self._markers:
            return None
        # ERNIE may close the reasoning without having opened it: only </think> matters.
        if self.end_token_id in delta_token_ids:
            reasoning, content = split_at(delta_text, self.end_token)
            content = self._strip_response_tags(content.lstrip("\n"), delta_token_ids)
            return DeltaMessage(reasoning=reasoning, content=content or None)
        if self.end_token_id in previous_token_ids:
            # The newlines that follow </think> and </response> separate sections; they are not answer text.
            if previous_text.endswith((self.end_token, self.response_end_token, self.end_token + "\n")):
                delta_text = delta_text.lstrip("\n")
            content = self._strip_response_tags(delta_text, delta_token_ids)
            return DeltaMessage(content=content or None)
        return DeltaMessage(reasoning=delta_text)
