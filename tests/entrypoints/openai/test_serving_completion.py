"""The completion stream generator without a server: usage and the fields each chunk carries (vLLM's)."""

from __future__ import annotations

import json

import pytest
from test_serving_chat import _outputs, _serving

from fastdeploy.engine.processor import ProcessedPrompt
from fastdeploy.entrypoints.openai.protocol import CompletionRequest
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy.utils.async_utils import merge_async_iterators


async def _completion_chunks(serving, body):
    request = CompletionRequest.model_validate({"prompt": [1, 2, 3], "stream": True, **body})
    prompts = [ProcessedPrompt("p", [1, 2, 3])]
    results = merge_async_iterators(_outputs([("a", None), ("b", "length")], [1, 2, 3]))
    events = [e async for e in serving._stream(request, prompts, results, "cmpl-x", 0)]
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.anyio
async def test_force_include_usage_puts_usage_on_every_completion_chunk():
    chunks = await _completion_chunks(_serving(OpenAIServingCompletion, force_usage=True), {})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {"prompt_tokens": 3, "total_tokens": 5,
                                                                   "completion_tokens": 2}


@pytest.mark.anyio
async def test_completion_chunks_carry_prompt_token_ids_first():
    serving = _serving(OpenAIServingCompletion)
    first, last = await _completion_chunks(serving, {"return_token_ids": True})
    assert first["choices"][0]["prompt_token_ids"] == [1, 2, 3] and last["choices"][0]["prompt_token_ids"] is None
    assert first["choices"][0]["token_ids"] == [10] and last["choices"][0]["token_ids"] == [11]
    assert "usage" not in first and "usage" not in last
    chunks = await _completion_chunks(serving, {"stream_options": {"include_usage": True}})
    assert ["usage" in c for c in chunks] == [False, False, True]
    assert all(c["choices"][0]["token_ids"] is None for c in chunks[:-1])


@pytest.mark.anyio
async def test_echo_with_return_token_ids_gives_the_prompt_as_ids_not_text():
    """vLLM's rule: with return_token_ids an echoed prompt comes back as prompt_token_ids, its text left out."""
    serving = _serving(OpenAIServingCompletion)
    first, _ = await _completion_chunks(serving, {"echo": True})
    assert first["choices"][0]["text"] == "pa" and first["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    first, last = await _completion_chunks(serving, {"echo": True, "return_token_ids": True})
    assert first["choices"][0]["text"] == "a" and first["choices"][0]["prompt_token_ids"] == [1, 2, 3]
    assert last["choices"][0]["text"] == "b"


def test_echo_without_a_tokenizer_is_the_prompt_token_ids_alone():
    """--skip-tokenizer-init: an echoed token-id prompt has no text (it was a 500 'NoneType ... decode')."""
    serving = OpenAIServingCompletion.__new__(OpenAIServingCompletion)
    serving.tokenizer = None
    assert serving._prompt_text(ProcessedPrompt(text=None, token_ids=[1, 2, 3])) == ""
    assert serving._prompt_text(ProcessedPrompt(text="Hi", token_ids=[1])) == "Hi"
