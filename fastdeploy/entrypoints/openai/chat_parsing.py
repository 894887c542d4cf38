"""Turning a chat answer into reasoning, content and tool calls, whole or streamed.

Per request, :class:`ChatOutputParser` combines what the server is configured
with: a reasoning parser (``--reasoning-parser``; the thinking goes to
``reasoning``), a tool-call parser for ``tool_choice="auto"``
(``--enable-auto-tool-choice --tool-call-parser``), and the parser of forced
tool calls (``tool_choice="required"`` or a named function, which structured
outputs enforce). The parsers themselves live in ``fastdeploy.reasoning`` and
``fastdeploy.entrypoints.openai.tool_parsers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, DeltaMessage
from fastdeploy.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ParsedAnswer:
    """A finished answer split into its parts."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # Tool calls found by a parser (or required): the finish reason becomes "tool_calls".
    tools_called: bool = False


@dataclass
class _ChoiceStream:
    """Streaming state of one choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    reasoning_done: bool = False
    # The answer after the reasoning, as fed to the tool-call parser.
    content_text: str = ""
    content_ids: list[int] = field(default_factory=list)
    reasoning_parser: Any = None
    tool_parser: Any = None


@dataclass
class ChatParserConfig:
    """The server's parser settings (from the command line)."""

    tool_parser_cls: Any = None
    reasoning_parser_cls: Any = None
    enable_auto_tools: bool = False

    @classmethod
    def from_names(cls, tool_call_parser: str | None, reasoning_parser: str | None,
                   enable_auto_tool_choice: bool) -> ChatParserConfig:
        """Look the parsers up by name; ValueError (listing the known names) for an unknown one."""
        config = cls(enable_auto_tools=enable_auto_tool_choice)
        if tool_call_parser:
            from fastdeploy.entrypoints.openai.tool_parsers import ToolParserManager

            config.tool_parser_cls = _lookup(ToolParserManager, "get_tool_parser", tool_call_parser, "tool call")
        if reasoning_parser:
            from fastdeploy.reasoning import ReasoningParserManager

            config.reasoning_parser_cls = _lookup(ReasoningParserManager, "get_reasoning_parser", reasoning_parser,
                                                  "reasoning")
        return config

    def check(self, tokenizer: Any) -> None:
        """Build the reasoning parser once at start-up, so a parser the model cannot use (its think
        tokens missing from the vocabulary) stops the server with the reason instead of failing every request.

        Raises:
            ValueError: naming the missing tokens.
        """
        if self.reasoning_parser_cls is not None:
            self.reasoning_parser_cls(tokenizer)


def _lookup(manager: Any, getter: str, name: str, kind: str) -> Any:
    try:
        return getattr(manager, getter)(name)
    except KeyError as e:
        raise ValueError(f"invalid {kind} parser: {name} (chose from {{ {','.join(manager.list_registered())} }})") from e


class ChatOutputParser:
    """Splits one request's answers (each of its ``n`` choices) into reasoning, content and tool calls."""

    def __init__(self, config: ChatParserConfig, request: ChatCompletionRequest, tokenizer: Any) -> None:
        from fastdeploy.entrypoints.openai.tool_parsers import named_tool_choice

        self.config = config
        self.request = request
        self.tokenizer = tokenizer
        self.forced = request.tool_choice == "required" or named_tool_choice(request.tool_choice) is not None
        self.auto_tools = (not self.forced and bool(request.tools) and request.tool_choice == "auto"
                           and config.enable_auto_tools and config.tool_parser_cls is not None)
        self.reasoning = config.reasoning_parser_cls is not None and request.include_reasoning
        self._streams: dict[int, _ChoiceStream] = {}

    def _reasoning_parser(self) -> Any:
        return self.config.reasoning_parser_cls(self.tokenizer,
                                                chat_template_kwargs=self.request.chat_template_kwargs or {})

    def _tool_streamer(self) -> Any:
        from fastdeploy.entrypoints.openai.tool_parsers import make_constrained_tool_call_streamer

        if self.forced:
            return make_constrained_tool_call_streamer(self.request.tool_choice)
        if self.auto_tools:
            return self.config.tool_parser_cls(self.tokenizer, self.request.tools)
        return None

    def adjust_request(self) -> ChatCompletionRequest:
        """Let the auto tool-call parser change the request before generation (as vLLM does)."""
        if self.auto_tools:
            self.request = self.config.tool_parser_cls(self.tokenizer, self.request.tools).adjust_request(self.request)
        return self.request

    # ---- whole answers --------------------------------------------------------------------
    def parse(self, text: str) -> ParsedAnswer:
        """Reasoning, content and tool calls of a finished answer."""
        reasoning, content = None, text
        if self.reasoning:
            reasoning, content = self._reasoning_parser().extract_reasoning(text, self.request)
        if self.forced:
            from fastdeploy.entrypoints.openai.tool_parsers import tool_calls_from_constrained_output

            try:
                calls = tool_calls_from_constrained_output(content or "", self.request.tool_choice)
            except ValueError:
                # Cut short (max_tokens): what was generated is reported as plain content.
                return ParsedAnswer(content, reasoning)
            return ParsedAnswer("", reasoning, [c.to_dict() for c in calls],
                                tools_called=self.request.tool_choice == "required")
        if self.auto_tools:
            info = self._tool_streamer().extract_tool_calls(content or "", self.request)
            if info.tools_called:
                return ParsedAnswer(info.content, reasoning, [c.to_dict() for c in info.tool_calls], True)
        return ParsedAnswer(content, reasoning)

    # ---- streaming ------------------------------------------------------------------------
    def stream_delta(self, index: int, delta_text: str, delta_ids: list[int]) -> DeltaMessage | None:
        """The delta to send for a choice's new text (None: nothing to send yet)."""
        if not self.reasoning and not self.forced and not self.auto_tools:
            return DeltaMessage(content=delta_text)
        state = self._streams.get(index)
        if state is None:
            state = self._streams[index] = _ChoiceStream(
                reasoning_done=not self.reasoning, tool_parser=self._tool_streamer(),
                reasoning_parser=self._reasoning_parser() if self.reasoning else None)
        reasoning = None
        content_text, content_ids = delta_text, list(delta_ids)
        if not state.reasoning_done:
            parser = state.reasoning_parser
            current_text, current_ids = state.text + delta_text, state.token_ids + list(delta_ids)
            delta = parser.extract_reasoning_streaming(state.text, current_text, delta_text, state.token_ids,
                                                       current_ids, delta_ids)
            state.text, state.token_ids = current_text, current_ids
            state.reasoning_done = parser.is_reasoning_end(current_ids)
            if delta is None:
                return None
            reasoning = delta.reasoning
            content_text = delta.content or ""
            content_ids = parser.extract_content_ids(list(delta_ids)) if state.reasoning_done else []
        if state.tool_parser is None or not (content_text or content_ids):
            if reasoning is None and not content_text:
                return None
            return DeltaMessage(reasoning=reasoning, reasoning_content=reasoning, content=content_text or None)
        previous_text, previous_ids = state.content_text, state.content_ids
        state.content_text, state.content_ids = previous_text + content_text, previous_ids + content_ids
        tool_delta = state.tool_parser.extract_tool_calls_streaming(
            previous_text, state.content_text, content_text, previous_ids, state.content_ids, content_ids,
            self.request)
        if tool_delta is None and reasoning is None:
            return None
        parts = tool_delta.to_dict() if tool_delta is not None else {}
        return DeltaMessage(reasoning=reasoning, reasoning_content=reasoning, content=parts.get("content"),
                            tool_calls=parts.get("tool_calls"))

    def streamed_tool_calls(self, index: int) -> bool:
        """Whether the parser found tool calls in a streamed choice (its finish reason is then "tool_calls")."""
        state = self._streams.get(index)
        if state is None or state.tool_parser is None:
            return False
        return bool(state.tool_parser.prev_tool_call_arr) and (self.auto_tools or
                                                               self.request.tool_choice == "required")
