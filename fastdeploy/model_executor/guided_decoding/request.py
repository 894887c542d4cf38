"""Per-request structured output state: the constraint's cache key and its (future) grammar."""

from __future__ import annotations

import enum
import json
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastdeploy.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from fastdeploy.config import StructuredOutputsConfig
    from fastdeploy.model_executor.guided_decoding.backend_xgrammar import XgrammarGrammar


class StructuredOutputOptions(enum.Enum):
    """The kind of constraint a request carries."""

    JSON = enum.auto()
    JSON_OBJECT = enum.auto()
    REGEX = enum.auto()
    GRAMMAR = enum.auto()
    CHOICE = enum.auto()
    STRUCTURAL_TAG = enum.auto()


@dataclass(frozen=True)
class StructuredOutputKey:
    """What identifies a compiled grammar: requests with equal keys share one compilation."""

    kind: StructuredOutputOptions
    spec: str
    any_whitespace: bool = True


def _canonical_json(value: Any) -> str:
    """One spelling per JSON value, so a schema sent as a dict or as text shares a cache entry.

    Key order is kept: it is the order in which the grammar makes the model write the properties.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            # Left as written: validation reports it; the key only has to be stable.
            return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def forbid_additional_properties(schema: Any) -> Any:
    """The JSON schema with ``additionalProperties: false`` on every object that does not set it.

    vLLM's ``disable_additional_properties``: an object schema then admits only the
    properties it lists, whatever the backend's default for unlisted ones. A schema
    given as text that does not parse is returned unchanged (validation reports it).
    """
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            return schema

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: walk(value) for key, value in node.items()}
        if out.get("type") == "object" and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    return walk(schema)


def get_structured_output_key(
    params: StructuredOutputsParams, config: StructuredOutputsConfig | None = None
) -> StructuredOutputKey:
    """The cache key of a request's constraint (engine config and per-request options folded in)."""
    any_whitespace = not (params.disable_any_whitespace or (config is not None and config.disable_any_whitespace))
    if params.json is not None:
        schema = params.json
        if params.disable_additional_properties or (config is not None and config.disable_additional_properties):
            schema = forbid_additional_properties(schema)
        return StructuredOutputKey(StructuredOutputOptions.JSON, _canonical_json(schema), any_whitespace)
    if params.json_object:
        return StructuredOutputKey(StructuredOutputOptions.JSON_OBJECT, "", any_whitespace)
    if params.regex is not None:
        return StructuredOutputKey(StructuredOutputOptions.REGEX, params.regex)
    if params.choice is not None:
        return StructuredOutputKey(StructuredOutputOptions.CHOICE, json.dumps(list(params.choice), ensure_ascii=False))
    if params.grammar is not None:
        return StructuredOutputKey(StructuredOutputOptions.GRAMMAR, params.grammar)
    if params.structural_tag is not None:
        return StructuredOutputKey(StructuredOutputOptions.STRUCTURAL_TAG, _canonical_json(params.structural_tag))
    # json_object=False is "set" for the exactly-one check but asks for nothing.
    raise ValueError(f"No valid structured output parameter found: {params}")


@dataclass
class StructuredOutputRequest:
    """The constraint of one engine request and its grammar once compiled.

    The grammar starts as a ``Future`` (compiled on the manager's thread pool)
    and is swapped for the ready grammar the first time it is looked at after
    the compilation finished; ``error`` holds a failed compilation.
    """

    params: StructuredOutputsParams
    key: StructuredOutputKey
    _grammar: Future | XgrammarGrammar | None = field(default=None, repr=False)
    error: BaseException | None = None
    # None until known: whether the prompt already closed the reasoning section.
    reasoning_ended: bool | None = None

    def _resolve(self) -> None:
        if isinstance(self._grammar, Future) and self._grammar.done():
            future, self._grammar = self._grammar, None
            try:
                self._grammar = future.result()
            except Exception as e:  # noqa: BLE001 - any compile failure finishes the request, never the engine
                self.error = e

    @property
    def is_ready(self) -> bool:
        """True once the grammar compiled (or failed to: see ``error``)."""
        self._resolve()
        return self._grammar is not None and not isinstance(self._grammar, Future) or self.error is not None

    @property
    def grammar(self) -> XgrammarGrammar | None:
        """The ready grammar, or None while it compiles or when it failed."""
        self._resolve()
        return None if isinstance(self._grammar, Future) else self._grammar

    @property
    def pending(self) -> Future | None:
        """The compilation still running, if any."""
        return self._grammar if isinstance(self._grammar, Future) and not self._grammar.done() else None
