"""Qwen3 / Qwen3.5: ``<think>`` reasoning ``</think>`` answer.

Newer chat templates put ``<think>`` in the prompt, so only ``</think>``
appears in the output; older ones let the model write ``<think>``: both work.
With ``enable_thinking=False`` (chat template argument) the output is all
answer. A ``<tool_call>`` followed by ``<function=`` also ends the reasoning
(Qwen3.5 may call a tool without closing its thoughts); a ``<tool_call>`` merely
mentioned in the thoughts does not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from fastdeploy.entrypoints.chat_deltas import DeltaMessage
from fastdeploy.reasoning.abs_reasoning_parsers import ReasoningParserManager
from fastdeploy.reasoning.basic_parsers import ThinkTagReasoningParser, split_at

_FUNCTION_OPEN = "<function"
_FUNCTION_OPEN_RE = re.compile(r"<function[\s=]")
# Tokens decoded after <tool_call> to see whether a function tag follows ("\n<function=" is at most 11).
_LOOKAHEAD_TOKENS = 16


@ReasoningParserManager.register_module("qwen3")
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3's thinking markers, thinking switch and implicit end at a tool call."""

    tool_call_tag = "<tool_call>"
    tool_call_end_tag = "</tool_call>"

    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        # Qwen3 thinks unless the request turned it off.
        self.thinking_enabled = bool(self.chat_template_kwargs.get("enable_thinking", True))
        self.tool_call_token_id = self.vocab.get(self.tool_call_tag)
        self.tool_call_end_token_id = self.vocab.get(self.tool_call_end_tag)
        # Streaming state: a "<tool_call>..." held back until we know whether a function follows.
        self._pending_tool_call: str | None = None
        self._ended_by_tool_call = False

    # ---- token-level ---------------------------------------------------------------------
    def _function_follows(self, input_ids: Sequence[int], tool_call_pos: int) -> bool:
        after = list(input_ids[tool_call_pos + 1 : tool_call_pos + 1 + _LOOKAHEAD_TOKENS])
        if not after:
            return False
        text = self.model_tokenizer.decode(after, skip_special_tokens=False)
        return bool(_FUNCTION_OPEN_RE.match(text.lstrip()))

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        for i in range(len(input_ids) - 1, -1, -1):
            token = input_ids[i]
            if token == self.start_token_id:
                return False
            if token == self.end_token_id:
                return True
            if token == self.tool_call_token_id and self.tool_call_token_id is not None:
                # A closed <tool_call>...</tool_call> pair is an example (e.g. in the prompt), not a call.
                closed = self.tool_call_end_token_id is not None and self.tool_call_end_token_id in input_ids[i + 1 :]
                if not closed and self._function_follows(input_ids, i):
                    return True
        return False

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        content = super().extract_content_ids(input_ids)
        if content or self.tool_call_token_id not in input_ids:
            return content
        last = len(input_ids) - 1 - input_ids[::-1].index(self.tool_call_token_id)
        return input_ids[last:]

    # ---- whole output --------------------------------------------------------------------
    def _tool_call_start(self, text: str) -> int:
        """Index of a ``<tool_call>`` that opens a real call (a function tag follows), or -1."""
        search = 0
        while (index := text.find(self.tool_call_tag, search)) != -1:
            if _FUNCTION_OPEN_RE.match(text[index + len(self.tool_call_tag) :].lstrip()):
                return index
            search = index + len(self.tool_call_tag)
        return -1

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if self.start_token in model_output:
            model_output = split_at(model_output, self.start_token)[1]
        if self.end_token in model_output:
            reasoning, content = split_at(model_output, self.end_token)
            return reasoning, content or None
        if not self.thinking_enabled:
            return None, model_output
        index = self._tool_call_start(model_output)
        if index != -1:
            return model_output[:index] or None, model_output[index:] or None
        # Thinking and never closed (cut off): everything is reasoning.
        return model_output, None

    # ---- streaming -----------------------------------------------------------------------
    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        if not self.thinking_enabled or self._ended_by_tool_call or self.end_token_id in previous_token_ids:
            return DeltaMessage(content=delta_text) if delta_text else None
        if self._pending_tool_call is not None:
            return self._resolve_pending(self._pending_tool_call + delta_text)
        if self.start_token_id in delta_token_ids:
            delta_text = split_at(delta_text, self.start_token)[1] if self.start_token in delta_text else delta_text
        if self.end_token_id in delta_token_ids:
            if self.end_token not in delta_text:
                return None
            reasoning, content = split_at(delta_text, self.end_token)
            if not reasoning and not content:
                return None
            return DeltaMessage(reasoning=reasoning or None, content=content or None)
        if self.tool_call_token_id in delta_token_ids and self.tool_call_tag in delta_text:
            index = delta_text.find(self.tool_call_tag)
            reasoning = delta_text[:index]
            resolved = self._resolve_pending(delta_text[index:])
            if resolved is None:  # held until the next chunk shows what follows the tag
                return DeltaMessage(reasoning=reasoning) if reasoning else None
            if resolved.content is not None:  # a real call: the answer starts here
                return DeltaMessage(reasoning=reasoning or None, content=resolved.content)
            return DeltaMessage(reasoning=delta_text)
        return DeltaMessage(reasoning=delta_text) if delta_text else None

    def _resolve_pending(self, text: str) -> DeltaMessage | None:
        """``text`` starts with ``<tool_call>``: a call (content), not yet known (held), or just reasoning."""
        after = text[len(self.tool_call_tag) :].lstrip()
        if _FUNCTION_OPEN_RE.match(after):
            self._pending_tool_call = None
            self._ended_by_tool_call = True
            return DeltaMessage(content=text)
        if _FUNCTION_OPEN.startswith(after):
            self._pending_tool_call = text
            return None
        self._pending_tool_call = None
        return DeltaMessage(reasoning=text)
