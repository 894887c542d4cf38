"""ChatOutputParser: reasoning, auto tool calls and forced tool calls, whole and streamed (no server)."""

from __future__ import annotations

import json

from fastdeploy.entrypoints.openai.chat_parsing import ChatOutputParser, ChatParserConfig
from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest
from tests.entrypoints.parser_test_utils import TagTokenizer, chunked

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ANSWER = ('<think>The user wants weather.</think>Let me check.<tool_call>{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}</tool_call>')


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Weather?"}], **fields})


def _stream(parser: ChatOutputParser, tokenizer: TagTokenizer, text: str) -> dict:
    """Send ``text`` through stream_delta in small chunks; merge what comes out."""
    merged = {"reasoning": "", "content": "", "name": None, "arguments": ""}
    for chunk in chunked(tokenizer.encode(text), seed=3):
        delta = parser.stream_delta(0, tokenizer.decode(chunk), chunk)
        if delta is None:
            continue
        merged["reasoning"] += delta.reasoning or ""
        merged["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            merged["name"] = call.get("function", {}).get("name") or merged["name"]
            merged["arguments"] += call.get("function", {}).get("arguments") or ""
    return merged


def test_reasoning_and_auto_tool_calls():
    tokenizer = TagTokenizer()
    config = ChatParserConfig.from_names("hermes", "deepseek_r1", enable_auto_tool_choice=True)
    request = _request(tools=TOOLS)
    whole = ChatOutputParser(config, request, tokenizer).parse(ANSWER)
    assert whole.reasoning == "The user wants weather."
    assert whole.tools_called and whole.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(whole.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}

    parser = ChatOutputParser(config, request, tokenizer)
    streamed = _stream(parser, tokenizer, ANSWER)
    assert streamed["reasoning"] == "The user wants weather."
    assert streamed["content"] == "Let me check."
    assert streamed["name"] == "get_weather" and json.loads(streamed["arguments"]) == {"city": "Paris"}
    assert parser.streamed_tool_calls(0)


def test_without_parsers_text_passes_through():
    parser = ChatOutputParser(ChatParserConfig(), _request(), TagTokenizer())
    assert parser.parse("plain").content == "plain"
    assert parser.stream_delta(0, "pla", [1]).content == "pla"


def test_include_reasoning_false_keeps_the_raw_text():
    config = ChatParserConfig.from_names(None, "deepseek_r1", enable_auto_tool_choice=False)
    answer = ChatOutputParser(config, _request(include_reasoning=False), TagTokenizer()).parse("<think>x</think>y")
    assert answer.reasoning is None and answer.content == "<think>x</think>y"


def test_named_tool_choice_is_parsed_from_the_constrained_answer():
    request = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    tokenizer = TagTokenizer()
    answer = ChatOutputParser(ChatParserConfig(), request, tokenizer).parse('{"city": "Paris"}')
    assert answer.tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    streamed = _stream(ChatOutputParser(ChatParserConfig(), request, tokenizer), tokenizer, '{"city": "Paris"}')
    assert streamed["name"] == "get_weather" and json.loads(streamed["arguments"]) == {"city": "Paris"}


def test_unknown_parser_names_list_the_known_ones():
    import pytest

    with pytest.raises(ValueError, match="invalid tool call parser: nope .*hermes"):
        ChatParserConfig.from_names("nope", None, True)
    with pytest.raises(ValueError, match="invalid reasoning parser: nope"):
        ChatParserConfig.from_names(None, "nope", False)
