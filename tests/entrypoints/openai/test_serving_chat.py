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
