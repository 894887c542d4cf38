"""OpenAI / vLLM request fields -> :class:`StructuredOutputsParams` (for the HTTP layer).

Accepted, as in vLLM: ``response_format`` (``text``, ``json_object``,
``json_schema``, ``structural_tag``), ``structured_outputs`` (a dict of
StructuredOutputsParams fields) and the legacy ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and
``guided_whitespace_pattern``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastdeploy.sampling_params import ParamValidationError, StructuredOutputsParams

_LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}


def _as_dict(value: Any) -> dict[str, Any]:
    """A plain dict from a dict or a pydantic model (by alias, so ``schema`` stays ``schema``)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump(by_alias=True, exclude_none=True)
    raise ParamValidationError(f"Expected an object, got {type(value).__name__}.", parameter="response_format")


def _response_format_fields(response_format: Any) -> dict[str, Any]:
    fmt = _as_dict(response_format)
    kind = fmt.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        json_schema = _as_dict(fmt.get("json_schema"))
        schema = json_schema.get("schema", json_schema.get("json_schema"))
        if schema is None:
            raise ParamValidationError(
                "response_format.json_schema.schema is required when response_format.type is 'json_schema'.",
                parameter="response_format",
            )
        return {"json": schema}
    if kind == "structural_tag":
        tag = {k: v for k, v in fmt.items() if k != "type"}
        # vLLM passes the whole response_format object (type included) on to xgrammar.
        return {"structural_tag": json.dumps({"type": "structural_tag", **tag})}
    raise ParamValidationError(
        f"response_format.type must be one of 'text', 'json_object', 'json_schema', 'structural_tag'; got {kind!r}.",
        parameter="response_format",
    )


def structured_outputs_from_openai(
    *,
    response_format: Any = None,
    structured_outputs: Any = None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
    guided_whitespace_pattern: str | None = None,
) -> StructuredOutputsParams | None:
    """The constraint a request asks for, or None.

    ``structured_outputs`` (or the legacy ``guided_*`` fields when it is absent)
    and ``response_format`` are merged; asking for two constraints raises the
    same ``ValueError`` as ``StructuredOutputsParams`` ("You can only use one kind
    of structured outputs constraint ...").

    Raises:
        ValueError: malformed fields or more than one constraint (the server answers 400).
    """
    if isinstance(structured_outputs, StructuredOutputsParams):
        fields = {k: v for k, v in vars(structured_outputs).items() if not k.startswith("_")}
    else:
        fields = _as_dict(structured_outputs)
    legacy = {
        "guided_json": guided_json,
        "guided_regex": guided_regex,
        "guided_choice": guided_choice,
        "guided_grammar": guided_grammar,
        "guided_whitespace_pattern": guided_whitespace_pattern,
    }
    for name, value in legacy.items():
        if value is not None and fields.get(_LEGACY_FIELDS[name]) is None:
            fields[_LEGACY_FIELDS[name]] = value
    for name, value in _response_format_fields(response_format).items():
        if fields.get(name) is not None and fields[name] != value:
            raise ParamValidationError(
                f"response_format and structured_outputs both set {name!r}; give one of them.",
                parameter="response_format",
            )
        fields[name] = value
    try:
        return StructuredOutputsParams.from_optional(**fields)
    except TypeError as e:
        raise ParamValidationError(f"Invalid structured_outputs: {e}", parameter="structured_outputs") from e


def structured_outputs_from_request(request: Any) -> StructuredOutputsParams | None:
    """The constraint of an OpenAI request model (completion or chat), read from its fields."""
    return structured_outputs_from_openai(
        response_format=getattr(request, "response_format", None),
        structured_outputs=getattr(request, "structured_outputs", None),
        guided_json=getattr(request, "guided_json", None),
        guided_regex=getattr(request, "guided_regex", None),
        guided_choice=getattr(request, "guided_choice", None),
        guided_grammar=getattr(request, "guided_grammar", None),
        guided_whitespace_pattern=getattr(request, "guided_whitespace_pattern", None),
    )
