"""ERNIE 4.5 format: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, answer text in ``<response>``."""

from __future__ import annotations

import json
import re
from typing import Any

from fastdeploy.entrypoints.chat_deltas import ExtractedToolCallInformation, FunctionCall, ToolCall
from fastdeploy.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    IncrementalToolParser,
    PartialToolCall,
    ScanResult,
    ToolParserManager,
)
from fastdeploy.entrypoints.openai.tool_parsers.utils import partial_tag_overlap
from fastdeploy.logger import init_logger

logger = init_logger(__name__)


@ToolParserManager.register_module("ernie45")
class Ernie45ToolParser(IncrementalToolParser):
    """Whole calls in ``<tool_call>`` tags; each is streamed at once when its closing tag arrives.

    Streamed content loses the ``<response>`` / ``</response>`` markers, as in vLLM.
    """

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    response_tags = ("<response>", "</response>")
    tool_call_regex = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

    @staticmethod
    def _call(obj: dict[str, Any]) -> FunctionCall:
        return FunctionCall(obj.get("name", ""), json.dumps(obj.get("arguments", {}), ensure_ascii=False))

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls = [ToolCall(self._call(json.loads(body))) for body in self.tool_call_regex.findall(model_output)]
        except Exception:  # noqa: BLE001 - malformed calls leave the output as plain content
            logger.debug("ERNIE tool call could not be parsed; returning the output as content.")
            return ExtractedToolCallInformation(False, [], model_output)
        content = model_output[: model_output.find(self.tool_call_start_token)].rstrip("\n")
        return ExtractedToolCallInformation(True, calls, content or None)

    def scan(self, text: str, request: Any) -> ScanResult:
        start = text.find(self.tool_call_start_token)
        if start == -1:
            # Trailing newlines wait: before a call they are dropped (as in the whole-output result).
            held_text = text.rstrip("\n")
            tags = (self.tool_call_start_token, *self.response_tags)
            return ScanResult(len(held_text) - max(partial_tag_overlap(held_text, t) for t in tags), [])
        calls = []
        for match in self.tool_call_regex.finditer(text, start):
            try:
                call = self._call(json.loads(match.group(1)))
            except json.JSONDecodeError:
                break
            calls.append(PartialToolCall(call.name, call.arguments))
        # Content before a call loses its trailing newlines (they separate it from the call).
        return ScanResult(len(text[:start].rstrip("\n")), calls)

    def filter_content(self, chunk: str) -> str:
        for tag in self.response_tags:
            chunk = chunk.replace(tag, "")
        return chunk
