"""What tool-call and reasoning parsers return: plain dataclasses in the OpenAI JSON shape.

They carry no dependency on the HTTP layer's pydantic models: ``to_dict()``
gives the exact JSON of the OpenAI field (``None`` members left out), which a
response model takes as is, e.g. ``DeltaMessage(**delta.to_dict())``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from typing import Any


def make_tool_call_id() -> str:
    """A fresh tool call id, in vLLM's ``chatcmpl-tool-<hex>`` form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _to_dict(obj: Any) -> Any:
    if isinstance(obj, list):
        return [_to_dict(item) for item in obj]
    if hasattr(obj, "__dataclass_fields__"):
        out = {}
        for f in fields(obj):
            value = getattr(obj, f.name)
            if value is not None:
                out[f.name] = _to_dict(value)
        return out
    return obj


class _JsonShape:
    def to_dict(self) -> dict[str, Any]:
        """The OpenAI JSON of this object, without ``None`` members."""
        return _to_dict(self)


@dataclass
class FunctionCall(_JsonShape):
    """A complete function call; ``arguments`` is a JSON string (as OpenAI sends it)."""

    name: str
    arguments: str


@dataclass
class ToolCall(_JsonShape):
    """One entry of ``message.tool_calls``."""

    function: FunctionCall
    id: str = field(default_factory=make_tool_call_id)
    type: str = "function"


@dataclass
class ExtractedToolCallInformation(_JsonShape):
    """Result of parsing a whole model output: the calls and the text around them.

    ``tools_called`` is False when the output holds no (well-formed) call; ``content``
    is then the whole output.
    """

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


@dataclass
class DeltaFunctionCall(_JsonShape):
    """A piece of a streamed function call: the name once, then argument text fragments."""

    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaToolCall(_JsonShape):
    """One entry of a streamed ``delta.tool_calls``; ``id`` and ``type`` come with the first piece."""

    index: int
    function: DeltaFunctionCall | None = None
    id: str | None = None
    type: str | None = None


@dataclass
class DeltaMessage(_JsonShape):
    """A streamed chat delta: new answer text, new reasoning text and/or tool-call pieces."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    @property
    def reasoning_content(self) -> str | None:
        """vLLM's former name of ``reasoning``."""
        return self.reasoning

    def to_dict(self) -> dict[str, Any]:
        """OpenAI delta JSON; ``tool_calls`` only when there are some."""
        out = _to_dict(self)
        if not out.get("tool_calls"):
            out.pop("tool_calls", None)
        return out
