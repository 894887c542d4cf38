"""Text helpers shared by the tool parsers: partial tags, JSON value bounds, tool schemas."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from fastdeploy.sampling_params import ParamValidationError

_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``.

    Streaming holds those characters back: they may be the start of the tag.
    """
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def json_value_end(text: str, start: int) -> int:
    """Index just past the JSON object/array opening at ``text[start]``, or -1 while it is unclosed.

    Braces inside strings are skipped; nothing else is validated.
    """
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def partial_call_name(call_json: str) -> str | None:
    """The ``"name"`` of a (possibly unfinished) call object, once its string is closed."""
    match = _NAME_RE.search(call_json)
    if match is None:
        return None
    try:
        return json.loads(f'"{match.group(1)}"')
    except json.JSONDecodeError:
        return None


def partial_call_arguments(call_json: str, keys: tuple[str, ...] = ("arguments",)) -> str | None:
    """The raw text of a call object's arguments value so far (exactly the value once it closed).

    Streaming sends this text as it grows; its final form is valid JSON, so the
    concatenated fragments parse.
    """
    for key in keys:
        match = re.search(rf'"{key}"\s*:\s*', call_json)
        if match is None:
            continue
        value = call_json[match.end() :]
        if not value:
            return None
        if value[0] in "{[":
            end = json_value_end(value, 0)
            return value if end == -1 else value[:end]
        # A scalar argument value: only whole, once the object closed.
        try:
            parsed, _ = json.JSONDecoder().raw_decode(value)
        except json.JSONDecodeError:
            return None
        return json.dumps(parsed, ensure_ascii=False)
    return None


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump(by_alias=True, exclude_none=True)
    return dict(vars(obj))


def tool_functions(tools: Any) -> dict[str, dict[str, Any]]:
    """``{function name: its parameters schema}`` of OpenAI ``tools`` (dicts or pydantic models)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or ()):
        tool = _as_dict(tool)
        function = tool.get("function") or {}
        if not isinstance(function, Mapping) and not hasattr(function, "model_dump"):
            raise ParamValidationError(f"tools[{i}].function must be an object, got {type(function).__name__}.",
                                       parameter="tools")
        function = _as_dict(function)
        name = function.get("name")
        parameters = function.get("parameters") or {}
        if not isinstance(parameters, Mapping):
            # The parameters become a JSON schema (tool_choice "required" / named) and reach templates as one.
            raise ParamValidationError(
                f"tools[{i}].function.parameters must be a JSON schema object, got {type(parameters).__name__}.",
                parameter="tools")
        if name:
            out[name] = dict(parameters)
    return out


def request_tools(request: Any) -> Any:
    """The ``tools`` of a request (model or dict), or None."""
    if request is None:
        return None
    if isinstance(request, Mapping):
        return request.get("tools")
    return getattr(request, "tools", None)
