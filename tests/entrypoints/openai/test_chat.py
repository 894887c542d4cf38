"""/v1/chat/completions end to end: SDK sync/async/stream, role chunk, usage, logprobs, n, templates."""

from __future__ import annotations

import httpx
import pytest
from remote_server import MODEL_NAME

pytestmark = pytest.mark.slow

# A phrasing both the GGUF default and the dequantized path answer with Paris (tests/entrypoints/test_llm.py:
# "What is the capital of France?" sits on a near-tie that the GGUF blocks flip).
QUESTION = [{"role": "user", "content": "Name the capital of France."}]


def test_chat_greedy_answer(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=20, temperature=0)
    assert chat.id.startswith("chatcmpl-")
    assert chat.object == "chat.completion"
    choice = chat.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == "The capital of France is Paris."
    assert choice.finish_reason == "stop"
    assert chat.usage.completion_tokens == 8  # the 7 answer tokens and <|im_end|>
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 8


def test_chat_stream_role_first_and_usage_last(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_stream_equals_non_stream_with_seed(client):
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12,
                  temperature=1.0, seed=99)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == full


def test_chat_logprobs(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == ["The", " capital", " of"]
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob <= 0


def test_chat_n(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=4, n=3, temperature=1.0)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]


def test_chat_system_prompt_and_template_kwargs(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": "Answer in one word."}, *QUESTION], max_tokens=5,
        temperature=0, extra_body={"chat_template_kwargs": {"unused_flag": True}})
    assert chat.choices[0].message.content


def test_continue_final_message_and_echo(server):
    body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True,
            "messages": [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]}
    r = httpx.post(server.url_for("v1", "chat", "completions"), json=body, headers=server.headers)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("The capital of France is Paris")


def test_content_parts(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=20, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}])
    assert chat.choices[0].message.content == "The capital of France is Paris."


def test_tools_with_tool_choice_none_reach_template(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=3, temperature=0,
                                          tools=tools, tool_choice="none")
    assert chat.choices[0].message.content


@pytest.mark.anyio
async def test_async_chat_stream(server):
    async with server.get_async_client() as client:
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=20,
                                                      temperature=0, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "The capital of France is Paris."


# ---- vLLM's extension fields ----------------------------------------------------------------
def test_chat_prompt_logprobs_and_null_fields(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == len(chat.prompt_token_ids)
    for token_id, entry in zip(chat.prompt_token_ids[1:], chat.prompt_logprobs[1:], strict=True):
        assert list(entry) == [str(token_id)] and entry[str(token_id)]["rank"] >= 1
    assert len(chat.choices[0].token_ids) == 1
    # Not asked for: the SDK still finds them, as null.
    plain = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=1)
    assert plain.prompt_logprobs is None and plain.prompt_token_ids is None and plain.choices[0].token_ids is None


def test_chat_message_keys_are_vllms(server):
    """The message carries vLLM's keys, tool_calls as [] when none were called."""
    r = httpx.post(server.url_for("v1", "chat", "completions"), headers=server.headers,
                   json={"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 1})
    message = r.json()["choices"][0]["message"]
    assert message["tool_calls"] == []
    assert {"refusal", "annotations", "audio", "function_call", "reasoning"} <= set(message)


def test_chat_stream_return_token_ids(client):
    kwargs = dict(model=MODEL_NAME, messages=QUESTION, max_tokens=5, temperature=0,
                  extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all("prompt_token_ids" not in c.model_dump() for c in chunks[1:])
    streamed = [t for c in chunks if c.choices and "token_ids" in c.choices[0].model_dump()
                for t in c.choices[0].token_ids]
    assert streamed == whole.choices[0].token_ids


def test_chat_logprob_token_ids(client, server):
    asked = [100, 1000, 5000]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=1, temperature=0,
                                          logprobs=True, top_logprobs=len(asked),
                                          extra_body={"logprob_token_ids": asked, "return_tokens_as_token_ids": True})
    entry = chat.choices[0].logprobs.content[0]
    assert [t.token for t in entry.top_logprobs] == [entry.token, *(f"token_id:{t}" for t in asked)]
    assert entry.top_logprobs[0].logprob == entry.logprob
    r = httpx.post(server.url_for("v1", "chat", "completions"), headers=server.headers,
                   json={"messages": QUESTION, "max_tokens": 1, "logprob_token_ids": asked})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "when using `logprob_token_ids`, `logprobs` must be set to true."


def test_chat_continuous_usage_starts_on_the_role_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True,
                                                                              "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chunks] == [0, 1, 2, 2]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices == []
