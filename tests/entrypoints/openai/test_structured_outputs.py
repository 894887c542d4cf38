"""Structured outputs through the API (guided_*, response_format, structured_outputs) and forced tool calls."""

from __future__ import annotations

import json

import pytest
from remote_server import MODEL_NAME

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_guided_choice_and_regex(client):
    choice = client.completions.create(model=MODEL_NAME, prompt="Is Paris in France? Answer:", max_tokens=5,
                                       temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(model=MODEL_NAME, prompt="A number:", max_tokens=8, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(regex.choices[0].text) == 3 and regex.choices[0].text.isdigit()


def test_response_format_json_schema(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    assert isinstance(json.loads(chat.choices[0].message.content)["city"], str)


def test_response_format_json_object(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=40, temperature=0,
                                          response_format={"type": "json_object"})
    content = chat.choices[0].message.content
    # A small model may run out of tokens inside the object; whatever it wrote is JSON-shaped.
    assert content.lstrip().startswith("{")
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_named_tool_choice(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40, temperature=0,
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = chat.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert "city" in json.loads(call.function.arguments)


def test_required_tool_choice(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=60, temperature=0,
        tools=[WEATHER_TOOL], tool_choice="required")
    calls = chat.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls)
    json.loads(calls[0].function.arguments)


def test_named_tool_choice_stream(client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40, temperature=0,
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "city" in json.loads("".join(d.function.arguments or "" for d in deltas))
