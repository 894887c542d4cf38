"""Every bad input gets vLLM's error envelope and status (400/401/404, never 422/500); the server lives on."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from remote_server import MODEL_NAME

pytestmark = pytest.mark.slow

CHAT = "v1/chat/completions"
CMPL = "v1/completions"
TOKENIZE = "tokenize"
MESSAGES = [{"role": "user", "content": "Hi"}]

# (route, body, status, param or None, a fragment of the message)
BAD_REQUESTS = [
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens", "integer"),
    (CMPL, {"model": MODEL_NAME}, 400, "prompt", "prompt"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "temperature": -1}, 400, "temperature",
     "temperature must be non-negative"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "top_k": -2}, 400, "top_k", "top_k must be 0"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "n": 2, "temperature": 0}, 400, "n", "greedy"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "stop": [""]}, 400, "stop", "empty string"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400, None, "greater than max allowed: 20"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "suffix": "y"}, 400, "suffix", "suffix"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream=True"),
    (CMPL, {"model": MODEL_NAME, "prompt": [999999]}, 400, None, "out of vocabulary"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "guided_choice": ["a"], "guided_regex": "b+"}, 400, None,
     "one kind of structured outputs"),
    (CMPL, {"model": MODEL_NAME, "prompt": "x", "priority": 3}, 400, "priority", "Priority scheduling"),
    (CMPL, {"model": "no-such-model", "prompt": "x"}, 404, "model", "does not exist"),
    (CHAT, {"model": MODEL_NAME}, 400, "messages", "messages"),
    (CHAT, {"model": MODEL_NAME, "messages": "hello"}, 400, "messages", ""),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, 400, None,
     "greater than max allowed"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "response_format": {"type": "json_schema"}}, 400,
     "response_format", "json_schema"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "guided_choice": ["a"], "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "not both"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "tool_choice": {"type": "function", "function": {"name": "g"}},
            "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "has not been passed"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES,
            "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", "auto"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, None, "text only"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "continue_final_message": True}, 400,
     "continue_final_message", "add_generation_prompt"),
    (CHAT, {"model": "no-such-model", "messages": MESSAGES}, 404, "model", "does not exist"),
    # Request data that request preparation cannot use is the client's error, never a 500.
    (CHAT, {"model": MODEL_NAME, "messages": [], "max_tokens": 4}, 400, "messages", "at least 1 item"),
    (TOKENIZE, {"messages": []}, 400, "messages", "at least 1 item"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]}, 400, "tools",
     "tools[0].function.parameters must be a JSON schema object, got int"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "tool_choice": "required",
            "tools": [{"type": "function", "function": "f"}]}, 400, "tools", "tools[0].function must be an object"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": "{{ raise_exception('no system turn') }}"},
     400, "messages", "no system turn"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": "{% for m in messages %}"}, 400, "messages",
     "TemplateSyntaxError"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "chat_template": "{{ 1 / 0 }}"}, 400, "messages",
     "ZeroDivisionError"),
    (TOKENIZE, {"messages": MESSAGES, "chat_template": "{{ messages[3].content.upper() }}"}, 400, "messages",
     "UndefinedError"),
    (TOKENIZE, {"messages": MESSAGES, "chat_template": "{{ messages[0].content + 1 }}"}, 400, "messages",
     "Invalid messages for the chat template: TypeError"),
    (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": [{"text": "hi"}]}]}, 400, None,
     "Content part type None"),
    (CHAT, {"model": MODEL_NAME, "messages": MESSAGES, "structured_outputs": {"json": 5}}, 400, None, "JSON"),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "fragment"), BAD_REQUESTS,
                         ids=[f"{r.split('/')[-1]}-{i}" for i, (r, *_) in enumerate(BAD_REQUESTS)])
def test_bad_request_envelope(server, route, body, status, param, fragment):
    r = httpx.post(server.url_for(*route.split("/")), json=body, headers=server.headers, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    if param is not None:
        assert error["param"] == param
    assert fragment in error["message"]


def test_malformed_json_is_400(server):
    r = httpx.post(server.url_for("v1", "completions"), content=b"{not json", headers={
        **server.headers, "Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"


def test_prompt_longer_than_context(server):
    body = {"model": MODEL_NAME, "prompt": [1] * 512, "max_tokens": 1}
    r = httpx.post(server.url_for("v1", "completions"), json=body, headers=server.headers)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "This model's maximum context length is 512 tokens. However, your request has 512 input tokens. "
        "Please reduce the length of the input messages.")


def test_huge_prompt_is_refused_by_size_without_tokenizing(server):
    """10 MB cannot fit 512 tokens: refused from its length at once, not after seconds of tokenization."""
    for route, body in ((CMPL, {"model": MODEL_NAME, "prompt": "word " * 2_000_000, "max_tokens": 1}),
                        (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "word " * 2_000_000}]})):
        start = time.monotonic()
        r = httpx.post(server.url_for(*route.split("/")), json=body, headers=server.headers, timeout=60)
        assert r.status_code == 400, r.text
        assert "characters" in r.json()["error"]["message"]
        assert time.monotonic() - start < 5


def test_health_answers_while_a_big_prompt_is_tokenized(server):
    """Tokenization runs off the event loop: /health stays quick during a multi-second /tokenize."""
    big = {"prompt": "hello world, this is text " * 240_000}

    async def scenario() -> tuple[httpx.Response, list[float]]:
        async with httpx.AsyncClient(timeout=120) as http:
            big_request = asyncio.create_task(http.post(server.url_for("tokenize"), json=big))
            latencies = []
            await asyncio.sleep(0.3)  # the body is sent and parsed; tokenization is under way
            while not big_request.done():
                start = time.monotonic()
                assert (await http.get(server.url_for("health"))).status_code == 200
                latencies.append(time.monotonic() - start)
                await asyncio.sleep(0.05)
            return await big_request, latencies

    response, latencies = asyncio.run(scenario())
    assert response.status_code == 200 and response.json()["count"] > 1_000_000
    assert len(latencies) >= 3, "the big request finished too fast to overlap /health"
    assert max(latencies) < 1.0, latencies


def test_max_tokens_is_clamped_to_the_context(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=[1] * 509, max_tokens=100000, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3
    assert completion.choices[0].finish_reason == "length"


def test_api_key_required(server):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 1}
    r = httpx.post(server.url_for("v1", "completions"), json=body)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == 401
    r = httpx.post(server.url_for("v1", "completions"), json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url_for("v1"), api_key="wrong", max_retries=0).models.list()
    # Routes outside /v1 stay open, as in vLLM.
    assert httpx.get(server.url_for("health")).status_code == 200


def test_sdk_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=-2)
    assert info.value.body["param"] == "temperature"


def test_server_still_answers(client):
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    assert completion.usage.completion_tokens == 2


def test_api_key_scheme_is_case_insensitive(server):
    """``bearer KEY`` is the same credential as ``Bearer KEY`` (RFC 9110; vLLM accepts it); another
    scheme, or the right scheme with a wrong key, is still refused."""
    url = server.url_for("v1", "models")
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert httpx.get(url, headers={"Authorization": f"{scheme} {server.api_key}"}).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"Basic {server.api_key}"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"bearer {server.api_key}x"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": server.api_key}).status_code == 401


def test_validation_errors_are_worded_as_vllm_words_them(client):
    """A value pydantic rejects is listed as vLLM lists it: the error type, the body path, the message."""
    for seed, kind in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, seed=seed)
        message = info.value.body["message"]
        assert message.startswith("1 validation error:\n  {")
        assert f"'type': '{kind}'" in message and "'loc': 'body.seed'" in message
        assert info.value.body["param"] == "seed"
