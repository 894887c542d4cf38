"""``tool_choice="required"`` and named-function choices, enforced with structured outputs (as vLLM).

- :func:`get_tool_choice_structured_outputs` gives the constraint to put on the
  request: for "required" a JSON array of ``{"name", "parameters"}`` objects, one
  schema per tool; for a named function that function's parameters schema.
- :func:`tool_calls_from_constrained_output` turns the finished output into
  tool calls; :func:`make_constrained_tool_call_streamer` streams them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastdeploy.entrypoints.chat_deltas import FunctionCall, ToolCall
from fastdeploy.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    IncrementalToolParser,
    PartialToolCall,
    ScanResult,
)
from fastdeploy.entrypoints.openai.tool_parsers.utils import (
    json_value_end,
    partial_call_arguments,
    partial_call_name,
    tool_functions,
)
from fastdeploy.sampling_params import ParamValidationError, StructuredOutputsParams

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def named_tool_choice(tool_choice: Any) -> str | None:
    """The function name of a named ``tool_choice`` (``{"type": "function", "function": {"name"}}``), else None."""
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    choice = tool_choice if isinstance(tool_choice, Mapping) else tool_choice.model_dump()
    function = choice.get("function") or {}
    if not isinstance(function, Mapping):
        function = function.model_dump()
    return function.get("name")


def _merged_defs(functions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``$defs`` of every tool's parameters, hoisted to the array schema's root."""
    defs: dict[str, Any] = {}
    for name, params in functions.items():
        tool_defs = params.get("$defs") or {}
        if not isinstance(tool_defs, Mapping):
            raise ParamValidationError(f"The `$defs` of tool {name!r} must be an object.", parameter="tools")
        for key, schema in tool_defs.items():
            if key in defs and defs[key] != schema:
                raise ParamValidationError(
                    f"Tool definition '{key}' has multiple schemas, which is not supported (tool {name!r}).",
                    parameter="tools",
                )
            defs[key] = schema
    return defs


def get_required_tools_json_schema(tools: Any, parallel_tool_calls: bool = True) -> dict[str, Any]:
    """JSON schema of a non-empty array of calls ``{"name": <tool>, "parameters": <its arguments>}``.

    ``parallel_tool_calls=False`` (OpenAI's request field) allows exactly one call.
    """
    functions = tool_functions(tools)
    if not functions:
        raise ParamValidationError("tool_choice='required' needs at least one tool in `tools`.", parameter="tools")
    variants = []
    for name, params in functions.items():
        params = {k: v for k, v in params.items() if k != "$defs"} or _EMPTY_PARAMETERS
        variants.append(
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    defs = _merged_defs(functions)
    if defs:
        schema["$defs"] = defs
    return schema


def get_tool_choice_structured_outputs(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None = True
) -> StructuredOutputsParams | None:
    """The constraint enforcing ``tool_choice``; None for "none", "auto" or no choice.

    ``parallel_tool_calls=False`` limits "required" to a single call.

    Raises:
        ValueError: the named function is not among ``tools``.
    """
    if tool_choice == "required":
        return StructuredOutputsParams(json=get_required_tools_json_schema(tools, parallel_tool_calls is not False))
    name = named_tool_choice(tool_choice)
    if name is None:
        return None
    functions = tool_functions(tools)
    if name not in functions:
        raise ParamValidationError(f"Tool '{name}' has not been passed in `tools`.", parameter="tool_choice")
    return StructuredOutputsParams(json=functions[name] or _EMPTY_PARAMETERS)


def tool_calls_from_constrained_output(text: str, tool_choice: Any) -> list[ToolCall]:
    """The tool calls of an output generated under :func:`get_tool_choice_structured_outputs`.

    Raises:
        ValueError: the output is not a complete call (e.g. cut off by ``max_tokens``).
    """
    if tool_choice == "required":
        try:
            calls = json.loads(text)
            return [
                ToolCall(FunctionCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False)))
                for call in calls
            ]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"The output is not a complete list of tool calls: {e}") from e
    name = named_tool_choice(tool_choice)
    if name is None:
        raise ValueError(f"tool_choice {tool_choice!r} is not enforced by structured outputs.")
    return [ToolCall(FunctionCall(name, text))]


class _RequiredToolCallStreamer(IncrementalToolParser):
    """Streams the calls of a ``[{"name": ..., "parameters": {...}}, ...]`` output."""

    def extract_tool_calls(self, model_output: str, request: Any):  # pragma: no cover - not used for this mode
        raise NotImplementedError("Use tool_calls_from_constrained_output for a finished output.")

    def scan(self, text: str, request: Any) -> ScanResult:
        calls = []
        pos = text.find("[")
        while pos != -1:
            pos += 1
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(text) or text[pos] != "{":
                break
            end = json_value_end(text, pos)
            body = text[pos:] if end == -1 else text[pos:end]
            calls.append(PartialToolCall(partial_call_name(body), partial_call_arguments(body, ("parameters",))))
            pos = end - 1 if end != -1 else -1
        return ScanResult(0, calls)


class _NamedToolCallStreamer(IncrementalToolParser):
    """Streams a named function's call: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def extract_tool_calls(self, model_output: str, request: Any):  # pragma: no cover - not used for this mode
        raise NotImplementedError("Use tool_calls_from_constrained_output for a finished output.")

    def scan(self, text: str, request: Any) -> ScanResult:
        return ScanResult(0, [PartialToolCall(self.name, text or None)])


def make_constrained_tool_call_streamer(tool_choice: Any) -> IncrementalToolParser:
    """A per-request streamer of the tool calls enforced by ``tool_choice`` ("required" or named).

    Its ``extract_tool_calls_streaming(...)`` has the :class:`ToolParser` signature.
    """
    if tool_choice == "required":
        return _RequiredToolCallStreamer()
    name = named_tool_choice(tool_choice)
    if name is None:
        raise ValueError(f"tool_choice {tool_choice!r} is not enforced by structured outputs.")
    return _NamedToolCallStreamer(name)
