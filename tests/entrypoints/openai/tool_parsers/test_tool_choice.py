"""tool_choice="required" and named functions, enforced by structured outputs: schemas, parsing, streaming, e2e."""

from __future__ import annotations

import json

import jsonschema
import pytest

from fastdeploy import SamplingParams
from fastdeploy.entrypoints.openai.tool_parsers import (
    get_required_tools_json_schema,
    get_tool_choice_structured_outputs,
    make_constrained_tool_call_streamer,
    tool_calls_from_constrained_output,
)
from fastdeploy.model_executor.guided_decoding import validate_structured_outputs
from tests.entrypoints.parser_test_utils import TagTokenizer, merge_tool_deltas, parsed_arguments, stream

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 16},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                               "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                "required": ["a", "b"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}} for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "add"}}


def test_required_schema_accepts_exactly_calls_of_the_tools():
    schema = get_required_tools_json_schema(TOOLS)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}], schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "add", "parameters": {"a": "x", "b": 1}}],
                [{"name": "add"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    validate_structured_outputs(get_tool_choice_structured_outputs(TOOLS, "required"))
    single = get_tool_choice_structured_outputs(TOOLS, "required", parallel_tool_calls=False).json
    jsonschema.validate([{"name": "now", "parameters": {}}], single)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "now", "parameters": {}}] * 2, single)


def test_required_schema_hoists_defs():
    tools = [
        {"function": {"name": "f", "parameters": {"$defs": {"P": {"type": "integer"}},
                                                  "properties": {"p": {"$ref": "#/$defs/P"}}}}},
        {"function": {"name": "g", "parameters": {"$defs": {"P": {"type": "integer"}}, "properties": {}}}},
    ]
    schema = get_required_tools_json_schema(tools)
    assert schema["$defs"] == {"P": {"type": "integer"}}
    jsonschema.validate([{"name": "f", "parameters": {"p": 1}}], schema)
    tools[1]["function"]["parameters"]["$defs"]["P"] = {"type": "string"}
    with pytest.raises(ValueError, match="multiple schemas"):
        get_required_tools_json_schema(tools)


def test_tool_choice_constraints():
    assert get_tool_choice_structured_outputs(TOOLS, "none") is None
    assert get_tool_choice_structured_outputs(TOOLS, "auto") is None
    assert get_tool_choice_structured_outputs(TOOLS, None) is None
    assert get_tool_choice_structured_outputs(TOOLS, NAMED).json == SCHEMAS["add"]
    assert get_tool_choice_structured_outputs(TOOLS, {"type": "function", "function": {"name": "now"}}).json == {
        "type": "object", "properties": {}}
    with pytest.raises(ValueError, match="Tool 'nope' has not been passed in `tools`."):
        get_tool_choice_structured_outputs(TOOLS, {"type": "function", "function": {"name": "nope"}})


def test_outputs_to_tool_calls():
    calls = tool_calls_from_constrained_output('[{"name": "add", "parameters": {"a": 1, "b": 2}}]', "required")
    assert parsed_arguments(calls) == [("add", {"a": 1, "b": 2})]
    named = tool_calls_from_constrained_output('{"a": 5, "b": 6}', NAMED)
    assert parsed_arguments(named) == [("add", {"a": 5, "b": 6})]
    with pytest.raises(ValueError, match="not a complete list"):
        tool_calls_from_constrained_output('[{"name": "add", "parameters": {"a": 1', "required")


@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_constrained_calls(seed):
    tokenizer = TagTokenizer()
    output = '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}, {"name": "now", "parameters": {}}]'
    streamer = make_constrained_tool_call_streamer("required")
    content, calls = merge_tool_deltas(stream(tokenizer, output, streamer.extract_tool_calls_streaming, seed=seed,
                                              request=None))
    assert content == ""
    assert parsed_arguments(calls) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("now", {})]
    streamer = make_constrained_tool_call_streamer(NAMED)
    _, calls = merge_tool_deltas(stream(tokenizer, '{"a": 1, "b": 2}', streamer.extract_tool_calls_streaming,
                                        seed=seed, request=None))
    assert parsed_arguments(calls) == [("add", {"a": 1, "b": 2})]


@pytest.mark.slow
def test_required_and_named_tool_calls_end_to_end(smol_llm):
    tokenizer = smol_llm.get_tokenizer()
    questions = ["What is the weather in Paris?", "What is 17 plus 25?", "Tell me the weather in Tokyo in fahrenheit."]
    system = "You can call these tools: " + json.dumps([t["function"] for t in TOOLS])
    prompts = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append({"prompt_token_ids": list(ids)})
    # One call per answer: a 135M model otherwise tends to repeat calls until max_tokens.
    required = get_tool_choice_structured_outputs(TOOLS, "required", parallel_tool_calls=False)
    required.disable_any_whitespace = True
    named = get_tool_choice_structured_outputs(TOOLS, NAMED)
    named.disable_any_whitespace = True
    params = [SamplingParams(temperature=0, max_tokens=128, structured_outputs=required)] * len(questions)
    params.append(SamplingParams(temperature=0, max_tokens=64, structured_outputs=named))
    outputs = smol_llm.generate([*prompts, prompts[1]], params, use_tqdm=False)
    for out in outputs[:-1]:
        calls = tool_calls_from_constrained_output(out.outputs[0].text, "required")
        assert len(calls) == 1
        for name, arguments in parsed_arguments(calls):
            jsonschema.validate(arguments, SCHEMAS[name])
    (call,) = tool_calls_from_constrained_output(outputs[-1].outputs[0].text, NAMED)
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["add"])
