"""Chat template helpers of the chat endpoint (no server)."""

from __future__ import annotations

import pytest

from fastdeploy.entrypoints.openai.protocol import ChatCompletionMessageParam
from fastdeploy.entrypoints.openai.serving_chat import conversation_for_template, load_chat_template
from fastdeploy.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels


def test_chat_template_from_file_or_inline(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{%")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template("/no/such/template.jinja")


def test_conversation_for_template():
    messages = [
        ChatCompletionMessageParam.model_validate({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        ChatCompletionMessageParam.model_validate({"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}),
        ChatCompletionMessageParam.model_validate({"role": "tool", "content": "42", "tool_call_id": "1"}),
    ]
    user, assistant, tool = conversation_for_template(messages)
    assert user["content"] == "a\nb"
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert tool["tool_call_id"] == "1"


def test_served_model_names():
    models = OpenAIServingModels([BaseModelPath("a", "/m"), BaseModelPath("b", "/m")], 512)
    assert models.model_name == "a"
    assert models.is_base_model("b") and models.is_base_model(None) and not models.is_base_model("c")
    assert [card.id for card in models.show_available_models().data] == ["a", "b"]


# ---- streaming without a server: usage and the fields each chunk carries -----------------------
def _serving(cls, **flags):
    """A handler wired to no engine: enough for its stream generator over made-up outputs."""
    from fastdeploy.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels

    serving = object.__new__(cls)
    serving.models = OpenAIServingModels([BaseModelPath("m", "/m")], 64)
    serving.response_role = "assistant"
    serving.return_tokens_as_token_ids = False
    serving.enable_prompt_tokens_details = False
    serving.enable_force_include_usage = flags.get("force_usage", False)
    serving.enable_per_request_metrics = flags.get("per_request_metrics", False)
    serving.token_strings = lambda ids: [f"<{i}>" for i in ids]
    return serving


async def _outputs(steps, prompt_token_ids):
    from fastdeploy.outputs import CompletionOutput, RequestMetrics, RequestOutput

    for i, (text, finish) in enumerate(steps):
        # Queued at 100 s, scheduled 0.5 s later, first token at 101 s, one token a second after.
        metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                                 last_token_time=101.0 + i)
        yield RequestOutput("r", None, prompt_token_ids, None, [
            CompletionOutput(index=0, text=text, token_ids=[10 + i], cumulative_logprob=None, logprobs=None,
                             finish_reason=finish, stop_reason=None)], finish is not None, metrics=metrics)


async def _chat_chunks(serving, body):
    import json

    from fastdeploy.entrypoints.openai.chat_parsing import ChatOutputParser, ChatParserConfig
    from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                                    **body})
    parser = ChatOutputParser(ChatParserConfig(), request, None)
    events = [e async for e in serving._stream(request, parser, _outputs([("a", None), ("b", "length")], [1, 2, 3]),
                                                "chatcmpl-x", 0)]
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


@pytest.mark.anyio
async def test_force_include_usage_puts_usage_on_every_chat_chunk():
    """--enable-force-include-usage (vLLM's): usage on every chunk, the role chunk included, then a usage chunk."""
    from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat

    chunks = await _chat_chunks(_serving(OpenAIServingChat, force_usage=True), {})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 2]
    assert all(c["usage"]["prompt_tokens"] == 3 and "prompt_tokens_details" not in c["usage"] for c in chunks)
    assert chunks[-1]["choices"] == []


@pytest.mark.anyio
async def test_chat_chunks_carry_vllm_fields():
    from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat

    serving = _serving(OpenAIServingChat)
    role, first, last = await _chat_chunks(serving, {"return_token_ids": True})
    # prompt_token_ids on the role chunk only; token_ids on the token chunks; stop_reason on the last one.
    assert role["prompt_token_ids"] == [1, 2, 3] and "token_ids" not in role["choices"][0]
    assert "prompt_token_ids" not in first and "prompt_token_ids" not in last
    assert first["choices"][0]["token_ids"] == [10] and last["choices"][0]["token_ids"] == [11]
    assert "stop_reason" not in first["choices"][0] and last["choices"][0]["stop_reason"] is None
    assert all("usage" not in c for c in (role, first, last))
    # Not asked for: null on the role chunk, as vLLM sends it.
    role, first, _ = await _chat_chunks(serving, {"stream_options": {}})
    assert role["prompt_token_ids"] is None and first["choices"][0]["token_ids"] is None
    chunks = await _chat_chunks(serving, {"stream_options": {"include_usage": False, "continuous_usage_stats": True}})
    assert all("usage" not in c for c in chunks)


@pytest.mark.anyio
async def test_per_request_metrics_ride_on_the_final_usage_chunk_only():
    """--enable-per-request-metrics (vLLM's): the timings on the stream's usage chunk; unset elsewhere."""
    from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat

    usage = {"stream_options": {"include_usage": True}}
    chunks = await _chat_chunks(_serving(OpenAIServingChat, per_request_metrics=True), usage)
    assert ["metrics" in c for c in chunks] == [False, False, False, True]
    assert chunks[-1]["metrics"] == {"time_to_first_token_ms": 500.0, "generation_time_ms": 1000.0,
                                     "queue_time_ms": 500.0, "mean_itl_ms": 1000.0, "tokens_per_second": 2 / 1.5}
    chunks = await _chat_chunks(_serving(OpenAIServingChat), usage)
    assert not any("metrics" in c for c in chunks)
