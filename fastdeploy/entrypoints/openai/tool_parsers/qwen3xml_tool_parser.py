"""Qwen3 (Coder) XML format::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; they are converted to the JSON type the tool's
schema declares (numbers, booleans, objects, ...), as in vLLM.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from typing import Any

from fastdeploy.entrypoints.chat_deltas import ExtractedToolCallInformation, FunctionCall, ToolCall
from fastdeploy.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    IncrementalToolParser,
    PartialToolCall,
    ScanResult,
    ToolParserManager,
)
from fastdeploy.entrypoints.openai.tool_parsers.utils import partial_tag_overlap, request_tools, tool_functions
from fastdeploy.logger import init_logger

logger = init_logger(__name__)

_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NULLS = ("null", "none")
# Characters a real function name never contains; seeing one means the tag is not a call.
_NOT_IN_NAMES = frozenset("{}<>\"' \t\n\r")


def _declared_type(schema: Any) -> tuple[str, bool]:
    """(first non-null type, whether null is allowed) of a property schema; "string" when undeclared."""
    if not isinstance(schema, dict):
        return "string", False
    options = schema.get("type")
    if options is None and isinstance(schema.get("anyOf"), list):
        options = [o.get("type") for o in schema["anyOf"] if isinstance(o, dict) and "type" in o]
    if options is None:
        return "string", False
    if not isinstance(options, list):
        options = [options]
    names = [str(o).strip().lower() for o in options]
    non_null = [n for n in names if n != "null"]
    return (non_null[0] if non_null else "null"), "null" in names


def convert_param_value(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema asks for; unconvertible text stays a string."""
    kind, nullable = _declared_type(schema)
    lowered = value.lower()
    if nullable and lowered in _NULLS:
        return None
    if kind in _STRING_TYPES:
        return value
    if lowered in _NULLS:
        return None
    try:
        if kind.startswith(_INT_PREFIXES):
            return int(value)
        if kind.startswith(("num", "float")):
            number = float(value)
            return int(number) if number.is_integer() else number
    except ValueError:
        return value
    if kind in ("boolean", "bool", "binary"):
        return lowered == "true"
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


@dataclass
class _FunctionBlock:
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)
    closed: bool = False


@ToolParserManager.register_module(["qwen3_xml", "qwen3_coder"])
class Qwen3XMLToolParser(IncrementalToolParser):
    """``<function=NAME>`` blocks of ``<parameter=KEY>VALUE</parameter>`` inside ``<tool_call>`` tags."""

    tool_call_start_token = "<tool_call>"
    tool_call_end_token = "</tool_call>"
    function_prefix = "<function="
    function_end_token = "</function>"
    parameter_prefix = "<parameter="
    parameter_end_token = "</parameter>"

    def _content_end(self, text: str) -> int:
        """Where tool calls begin: the first ``<tool_call>`` with a function in it, else a bare ``<function=``."""
        search = 0
        while (start := text.find(self.tool_call_start_token, search)) != -1:
            close = text.find(self.tool_call_end_token, start)
            limit = close if close != -1 else len(text)
            if text.find(self.function_prefix, start, limit) != -1 or close == -1:
                return start
            search = close + len(self.tool_call_end_token)
        bare = text.find(self.function_prefix)
        return bare if bare != -1 else -1

    def _parse_params(self, body: str, closed: bool, schemas: dict[str, Any]) -> dict[str, Any]:
        """Complete parameters of a function body; an unterminated one counts only when the function closed."""
        params: dict[str, Any] = {}
        pos = body.find(self.parameter_prefix)
        while pos != -1:
            name_start = pos + len(self.parameter_prefix)
            name_end = body.find(">", name_start)
            if name_end == -1:
                break
            name = body[name_start:name_end]
            value_start = name_end + 1
            value_end = body.find(self.parameter_end_token, value_start)
            next_param = body.find(self.parameter_prefix, value_start)
            if value_end == -1 or (next_param != -1 and next_param < value_end):
                # No closing tag before the next parameter (malformed): that parameter ends it.
                if next_param != -1:
                    value_end = next_param
                elif closed:
                    value_end = len(body)
                else:
                    break
                following = next_param
            else:
                following = body.find(self.parameter_prefix, value_end)
            value = body[value_start:value_end]
            value = value.removeprefix("\n").removesuffix("\n")
            params[name] = convert_param_value(value, schemas.get(name))
            pos = following
        return params

    def _functions(self, text: str, request: Any, final: bool) -> list[_FunctionBlock]:
        """Every function block of ``text``; at the end of a finished output an open block counts as closed."""
        tools = tool_functions(request_tools(request) or self.tools)
        blocks: list[_FunctionBlock] = []
        pos = text.find(self.function_prefix)
        while pos != -1:
            name_start = pos + len(self.function_prefix)
            name_end = text.find(">", name_start)
            if name_end == -1:
                blocks.append(_FunctionBlock(None))
                break
            name = text[name_start:name_end]
            if not name or any(c in _NOT_IN_NAMES for c in name):
                # Not a function tag (e.g. "<function=f" cut short, or template text): not a call.
                break
            end = text.find(self.function_end_token, name_end)
            closed = end != -1 or final
            body = text[name_end + 1 : end if end != -1 else len(text)]
            if end == -1 and not final:
                body = body[: len(body) - partial_tag_overlap(body, self.function_end_token)]
            properties = (tools.get(name) or {}).get("properties") or {}
            blocks.append(_FunctionBlock(name, self._parse_params(body, closed, properties), closed))
            if end == -1:
                break
            pos = text.find(self.function_prefix, end)
        return blocks

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        if self.function_prefix not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            blocks = self._functions(model_output, request, final=True)
        except Exception:  # noqa: BLE001 - malformed calls leave the output as plain content
            logger.debug("Qwen3 XML tool call could not be parsed; returning the output as content.")
            return ExtractedToolCallInformation(False, [], model_output)
        calls = [
            ToolCall(FunctionCall(b.name, json.dumps(b.params, ensure_ascii=False))) for b in blocks if b.name
        ]
        self.prev_tool_call_arr = [{"name": c.function.name, "arguments": c.function.arguments} for c in calls]
        if not calls:
            return ExtractedToolCallInformation(False, [], model_output)
        content = model_output[: self._content_end(model_output)]
        return ExtractedToolCallInformation(True, calls, content or None)

    def scan(self, text: str, request: Any) -> ScanResult:
        content_end = self._content_end(text)
        if content_end == -1:
            held = max(partial_tag_overlap(text, t) for t in (self.tool_call_start_token, self.function_prefix))
            return ScanResult(len(text) - held, [])
        calls = []
        for block in self._functions(text, request, final=False):
            # Arguments grow one whole parameter at a time, so what was sent is always a prefix.
            items = [f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in block.params.items()]
            if block.closed:
                arguments = "{" + ", ".join(items) + "}"
            else:
                arguments = "{" + ", ".join(items) if items else None
            calls.append(PartialToolCall(block.name, arguments))
        return ScanResult(content_end, calls)
