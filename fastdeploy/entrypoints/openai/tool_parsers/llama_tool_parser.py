"""Llama 3.x / 4 JSON format: ``{"name": ..., "parameters": {...}}`` objects, optionally after ``<|python_tag|>``."""

from __future__ import annotations

import json
from typing import Any

from fastdeploy.entrypoints.chat_deltas import ExtractedToolCallInformation, FunctionCall, ToolCall
from fastdeploy.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    IncrementalToolParser,
    PartialToolCall,
    ScanResult,
    ToolParserManager,
)
from fastdeploy.entrypoints.openai.tool_parsers.utils import (
    json_value_end,
    partial_call_arguments,
    partial_call_name,
)
from fastdeploy.logger import init_logger

logger = init_logger(__name__)

# Between two calls: whitespace and the "; " separator the Llama template uses.
_SEPARATORS = " \t\r\n;"


@ToolParserManager.register_module(["llama3_json", "llama4_json"])
class Llama3JsonToolParser(IncrementalToolParser):
    """JSON call objects, separated by ``;``; either ``parameters`` or ``arguments`` holds the arguments.

    A complete output may carry the JSON anywhere (all of it must parse, or the
    output is plain content); a streamed one is treated as tool calls only when
    it starts with ``<|python_tag|>`` or ``{``, as in vLLM.
    """

    bot_token = "<|python_tag|>"

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.bot_token not in model_output and "{" not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        end = -1
        try:
            for start, char in enumerate(model_output):
                # Braces inside an object already read belong to it.
                if char != "{" or start < end:
                    continue
                obj, length = decoder.raw_decode(model_output[start:])
                end = start + length
                arguments = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(ToolCall(FunctionCall(obj["name"], json.dumps(arguments, ensure_ascii=False))))
        except Exception:  # noqa: BLE001 - any malformed object: the whole output is content
            logger.debug("Llama JSON tool call could not be parsed; returning the output as content.")
            return ExtractedToolCallInformation(False, [], model_output)
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        return ExtractedToolCallInformation(True, calls, None)

    def scan(self, text: str, request: Any) -> ScanResult:
        if text.startswith(self.bot_token):
            pos = len(self.bot_token)
        elif text.startswith("{"):
            pos = 0
        else:
            return ScanResult(len(text), [])
        calls = []
        while True:
            while pos < len(text) and text[pos] in _SEPARATORS:
                pos += 1
            if pos >= len(text) or text[pos] != "{":
                break
            end = json_value_end(text, pos)
            body = text[pos:] if end == -1 else text[pos:end]
            calls.append(PartialToolCall(partial_call_name(body), partial_call_arguments(body, ("parameters", "arguments"))))
            if end == -1:
                break
            pos = end
        return ScanResult(0, calls)
