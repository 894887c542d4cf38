"""Hermes 2 Pro format (also Qwen2.5 / Qwen3 instruct): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from fastdeploy.entrypoints.chat_deltas import ExtractedToolCallInformation, FunctionCall, ToolCall
from fastdeploy.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    IncrementalToolParser,
    PartialToolCall,
    ScanResult,
    ToolParserManager,
)
from fastdeploy.entrypoints.openai.tool_parsers.utils import (
    partial_call_arguments,
    partial_call_name,
    partial_tag_overlap,
)
from fastdeploy.logger import init_logger

logger = init_logger(__name__)


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(IncrementalToolParser):
    """Calls wrapped in ``<tool_call>`` tags, one JSON object each; text before the first call is content."""

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    # The last call may be cut off (no closing tag): it is still parsed.
    tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def adjust_request(self, request: Any) -> Any:
        """Keep special tokens in the text: ``<tool_call>`` is a special token in some vocabularies."""
        tools = request.get("tools") if isinstance(request, Mapping) else getattr(request, "tools", None)
        choice = request.get("tool_choice") if isinstance(request, Mapping) else getattr(request, "tool_choice", None)
        if tools and choice != "none":
            if isinstance(request, Mapping):
                request["skip_special_tokens"] = False
            else:
                request.skip_special_tokens = False
        return request

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.tool_call_start_token not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls = []
            for closed, unclosed in self.tool_call_regex.findall(model_output):
                obj = json.loads(closed or unclosed)
                calls.append(
                    ToolCall(FunctionCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
                )
        except Exception:  # noqa: BLE001 - malformed calls leave the output as plain content
            logger.debug("Hermes tool call could not be parsed; returning the output as content.")
            return ExtractedToolCallInformation(False, [], model_output)
        content = model_output[: model_output.find(self.tool_call_start_token)]
        return ExtractedToolCallInformation(True, calls, content or None)

    def scan(self, text: str, request: Any) -> ScanResult:
        start = text.find(self.tool_call_start_token)
        if start == -1:
            return ScanResult(len(text) - partial_tag_overlap(text, self.tool_call_start_token), [])
        calls = []
        while start != -1:
            body_start = start + len(self.tool_call_start_token)
            end = text.find(self.tool_call_end_token, body_start)
            if end == -1:
                body = text[body_start:]
                body = body[: len(body) - partial_tag_overlap(body, self.tool_call_end_token)]
            else:
                body = text[body_start:end]
            body = body.strip()
            calls.append(PartialToolCall(partial_call_name(body), partial_call_arguments(body)))
            if end == -1:
                break
            start = text.find(self.tool_call_start_token, end + len(self.tool_call_end_token))
        return ScanResult(text.find(self.tool_call_start_token), calls)
