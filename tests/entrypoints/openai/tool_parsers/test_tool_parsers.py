"""Tool-call parsers on recorded model outputs: plain text, one call, several calls, malformed; whole and streamed."""

from __future__ import annotations

import json

import pytest

from fastdeploy.entrypoints.openai.tool_parsers import ToolParserManager
from tests.entrypoints.parser_test_utils import TagTokenizer, merge_tool_deltas, parsed_arguments, stream

TOKENIZER = TagTokenizer()
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "extra": {"type": "object"},
                    "ratio": {"type": "number"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


class Request:
    """The fields of a chat request the parsers read."""

    def __init__(self, tools=WEATHER_TOOLS, tool_choice="auto"):
        self.tools = tools
        self.tool_choice = tool_choice
        self.skip_special_tokens = True


# (parser, output, expected content, expected [(name, arguments)]); no calls => content is the whole output.
CASES = {
    "hermes": [
        ("plain", "The weather in Paris is sunny today.", "The weather in Paris is sunny today.", []),
        (
            "one",
            'Let me check that.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
            "</tool_call>",
            "Let me check that.\n",
            [("get_weather", {"city": "Paris", "days": 3})],
        ),
        (
            "several",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {center}", "extra": {"a": [1, 2]}}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            None,
            [("get_weather", {"city": "Paris {center}", "extra": {"a": [1, 2]}}), ("get_time", {})],
        ),
        (
            "cut_off_after_json",
            '<tool_call>\n{"name": "get_time", "arguments": {}}',
            None,
            [("get_time", {})],
        ),
        ("malformed", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>', None, None),
    ],
    "llama3_json": [
        ("plain", "Paris is the capital of France.", "Paris is the capital of France.", []),
        (
            "one",
            '{"name": "get_weather", "parameters": {"city": "Paris", "metric": true}}',
            None,
            [("get_weather", {"city": "Paris", "metric": True})],
        ),
        (
            "python_tag",
            '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Rome"}}',
            None,
            [("get_weather", {"city": "Rome"})],
        ),
        (
            "several",
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
        ("malformed", '{"name": "get_weather", "parameters": {"city": "Os', None, None),
        ("malformed_missing_name", '{"function": "get_weather", "parameters": {}}', None, None),
    ],
    "qwen3_xml": [
        ("plain", "I can answer that directly: 42.", "I can answer that directly: 42.", []),
        (
            "one",
            "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
            "<parameter=days>\n5\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n"
            '<parameter=extra>\n{"unit": "C", "hourly": [1, 2]}\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n'
            "</function>\n</tool_call>",
            "Checking.\n",
            [("get_weather", {"city": "New York", "days": 5, "metric": False, "extra": {"unit": "C", "hourly": [1, 2]},
                              "ratio": 0.5})],
        ),
        (
            "several",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nline one\nline two\n</parameter>\n</function>\n"
            "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
            None,
            [("get_weather", {"city": "line one\nline two"}), ("get_time", {})],
        ),
        (
            "missing_closing_tags",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n<parameter=days>\n2\n</function>\n</tool_call>",
            None,
            [("get_weather", {"city": "Lima", "days": 2})],
        ),
        ("malformed", "<tool_call>\n<function=get_weather\n<parameter=city>", None, None),
    ],
    "ernie45": [
        ("plain", "<response>\nIt is sunny.\n</response>", "<response>\nIt is sunny.\n</response>", []),
        (
            "one",
            'I will look it up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Beijing"}}\n</tool_call>\n',
            "I will look it up.",
            [("get_weather", {"city": "Beijing"})],
        ),
        (
            "several",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Xi\'an", "days": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
            None,
            [("get_weather", {"city": "Xi'an", "days": 1}), ("get_time", {})],
        ),
        ("malformed", '<tool_call>\n{"name": "get_weather", "arguments": {city: Beijing}}\n</tool_call>', None, None),
    ],
}
PARAMS = [(name, *case) for name, cases in CASES.items() for case in cases]


def make_parser(name):
    return ToolParserManager.get_tool_parser(name)(TOKENIZER, WEATHER_TOOLS)


@pytest.mark.parametrize(("parser_name", "case", "output", "content", "calls"), PARAMS,
                         ids=[f"{p[0]}-{p[1]}" for p in PARAMS])
def test_extract_tool_calls(parser_name, case, output, content, calls):
    info = make_parser(parser_name).extract_tool_calls(output, Request())
    if not calls:
        assert not info.tools_called and info.tool_calls == [] and info.content == output
        return
    assert info.tools_called
    assert info.content == content
    assert parsed_arguments(info.tool_calls) == calls
    assert all(c.type == "function" and c.id.startswith("chatcmpl-tool-") for c in info.tool_calls)
    # OpenAI's JSON shape.
    assert info.tool_calls[0].to_dict()["function"]["name"] == calls[0][0]


WELL_FORMED = [p for p in PARAMS if not p[1].startswith("malformed")]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("parser_name", "case", "output", "content", "calls"), WELL_FORMED,
                         ids=[f"{p[0]}-{p[1]}" for p in WELL_FORMED])
def test_streaming_matches_whole_output(parser_name, case, output, content, calls, seed):
    parser = make_parser(parser_name)
    deltas = stream(TOKENIZER, output, parser.extract_tool_calls_streaming, seed=seed, request=Request())
    streamed_content, streamed_calls = merge_tool_deltas(deltas)
    if not calls:
        expected = output.replace("<response>", "").replace("</response>", "") if parser_name == "ernie45" else output
        assert streamed_content == expected and streamed_calls == []
        return
    assert streamed_content == (content or "")
    assert parsed_arguments(streamed_calls) == calls
    assert all(c["id"] for c in streamed_calls)
    # The state the server reads when the stream ends: what was found and what was sent.
    assert [c["name"] for c in parser.prev_tool_call_arr] == [name for name, _ in calls]
    assert [json.loads(a) for a in parser.streamed_args_for_tool] == [args for _, args in calls]


@pytest.mark.parametrize("parser_name", list(CASES))
def test_streaming_malformed_output_never_raises(parser_name):
    output = next(c[1] for c in CASES[parser_name] if c[0].startswith("malformed"))
    parser = make_parser(parser_name)
    deltas = stream(TOKENIZER, output, parser.extract_tool_calls_streaming, request=Request())
    _, calls = merge_tool_deltas(deltas)
    # Whatever was streamed of a broken call is at most a name and argument text; never a crash.
    assert all(isinstance(c["arguments"], str) for c in calls)


def test_registry():
    names = ToolParserManager.list_registered()
    assert {"hermes", "llama3_json", "qwen3_xml", "ernie45"} <= set(names)
    with pytest.raises(KeyError, match="not found in tool_parsers"):
        ToolParserManager.get_tool_parser("nope")


def test_hermes_keeps_special_tokens_when_tools_are_used():
    parser = make_parser("hermes")
    assert parser.adjust_request(Request()).skip_special_tokens is False
    assert parser.adjust_request(Request(tool_choice="none")).skip_special_tokens is True
    as_dict = {"tools": WEATHER_TOOLS, "tool_choice": "auto"}
    assert parser.adjust_request(as_dict)["skip_special_tokens"] is False


def test_qwen3_xml_undeclared_parameter_types():
    # No tools anywhere: every value stays a string.
    parser = ToolParserManager.get_tool_parser("qwen3_xml")(TOKENIZER)
    out = parser.extract_tool_calls(
        "<tool_call>\n<function=f>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>", Request(tools=None)
    )
    assert json.loads(out.tool_calls[0].function.arguments) == {"n": "5"}


def test_hermes_holds_back_a_partial_tag():
    parser = make_parser("hermes")
    first = parser.extract_tool_calls_streaming("", "Sure <tool", "Sure <tool", [], [], [], Request())
    assert first.content == "Sure "
    second = parser.extract_tool_calls_streaming("Sure <tool", "Sure <tools are", "s are", [], [], [], Request())
    assert second.content == "<tools are"
