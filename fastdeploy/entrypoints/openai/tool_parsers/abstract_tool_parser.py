"""The tool parser interface, its registry, and the shared streaming machinery.

A parser instance serves one request (it keeps that request's streaming state).
The HTTP layer calls:

- ``extract_tool_calls(model_output, request)`` on a finished output, and
- ``extract_tool_calls_streaming(previous_text, current_text, delta_text,
  previous_token_ids, current_token_ids, delta_token_ids, request)`` per streamed
  chunk, sending the returned :class:`DeltaMessage` (``None``: nothing to send yet).

After streaming, ``prev_tool_call_arr`` (``{"name", "arguments"}`` per call) and
``streamed_args_for_tool`` tell what was found and what was sent, as in vLLM.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from fastdeploy.entrypoints.chat_deltas import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    make_tool_call_id,
)
from fastdeploy.entrypoints.parser_registry import ParserManager, ParserRegistry
from fastdeploy.logger import init_logger

logger = init_logger(__name__)


class ToolParser(ABC):
    """Turns a model's raw output into OpenAI tool calls.

    Args:
        tokenizer: the model's tokenizer (parsers read special-token ids from it; may be None).
        tools: the request's ``tools``, for parsers that convert argument types.
    """

    def __init__(self, tokenizer: Any = None, tools: Any = None) -> None:
        self.model_tokenizer = tokenizer
        self.tools = tools
        self.prev_tool_call_arr: list[dict[str, Any]] = []
        self.streamed_args_for_tool: list[str] = []
        self.current_tool_id = -1

    @cached_property
    def vocab(self) -> dict[str, int]:
        """Token string -> id of the tokenizer (empty without one)."""
        from fastdeploy.transformers_utils.tokenizer import cached_vocab

        return cached_vocab(self.model_tokenizer)

    def adjust_request(self, request: Any) -> Any:
        """Change the request before generation when the format needs it (default: unchanged)."""
        return request

    @abstractmethod
    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        """Tool calls and remaining content of a complete output."""

    @abstractmethod
    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        """What to stream for the newest chunk (``current_text = previous_text + delta_text``)."""


@dataclass
class PartialToolCall:
    """A tool call as far as the text shows it.

    ``arguments`` is the JSON text of the arguments so far; the parser guarantees
    that later versions extend it, so it can be streamed as fragments.
    """

    name: str | None
    arguments: str | None = None


@dataclass
class ScanResult:
    """What a parser sees in the whole text so far.

    Attributes:
        content_end: index up to which the text is plain content that is safe to send
            (text that might still become a tool-call tag is held back).
        calls: the tool calls started so far, in order.
    """

    content_end: int
    calls: list[PartialToolCall]


class IncrementalToolParser(ToolParser):
    """A parser that re-reads the whole output on each chunk and streams only what is new.

    Subclasses implement :meth:`scan`; re-reading instead of tracking a state
    machine keeps streaming exactly consistent with :meth:`extract_tool_calls`,
    at a cost linear in the output per chunk (tool-call outputs are short).
    """

    def __init__(self, tokenizer: Any = None, tools: Any = None) -> None:
        super().__init__(tokenizer, tools)
        self._sent_content_idx = 0

    @abstractmethod
    def scan(self, text: str, request: Any) -> ScanResult:
        """Content bound and tool calls of ``text`` (an output that may still grow)."""

    def filter_content(self, chunk: str) -> str:
        """Hook to drop format markers from streamed content (default: keep all)."""
        return chunk

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        try:
            result = self.scan(current_text, request)
        except Exception:  # noqa: BLE001 - a parser bug must not kill the stream
            logger.exception("Error while streaming tool calls; skipping this chunk.")
            return None
        content = None
        if result.content_end > self._sent_content_idx:
            content = self.filter_content(current_text[self._sent_content_idx : result.content_end]) or None
            self._sent_content_idx = result.content_end
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(result.calls):
            if index >= len(self.prev_tool_call_arr):
                if call.name is None:
                    break  # calls stream in order: wait for this one's name
                self.prev_tool_call_arr.append({"name": call.name, "arguments": ""})
                self.streamed_args_for_tool.append("")
                self.current_tool_id = index
                deltas.append(
                    DeltaToolCall(index, DeltaFunctionCall(name=call.name), id=make_tool_call_id(), type="function")
                )
            sent = self.streamed_args_for_tool[index]
            args = call.arguments
            if args is None or len(args) <= len(sent):
                continue
            if not args.startswith(sent):
                # Cannot happen for the built-in parsers; never send text that contradicts what went out.
                logger.warning("Tool call %d arguments changed after streaming; ignoring the update.", index)
                continue
            self.streamed_args_for_tool[index] = args
            self.prev_tool_call_arr[index]["arguments"] = args
            fragment = args[len(sent) :]
            if deltas and deltas[-1].index == index and deltas[-1].function is not None:
                deltas[-1].function.arguments = fragment
            else:
                deltas.append(DeltaToolCall(index, DeltaFunctionCall(arguments=fragment)))
        if content is None and not deltas:
            return None
        return DeltaMessage(content=content, tool_calls=deltas)


class ToolParserManager(ParserManager):
    """Registry of tool parsers by ``--tool-call-parser`` name (vLLM's classmethod API)."""

    registry: ParserRegistry[ToolParser] = ParserRegistry("tool", "tool_parsers")

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class registered as ``name``; KeyError listing the known names otherwise."""
        return cls.registry.get(name)
