"""Request models: unknown fields ignored, vLLM's checks with the offending parameter, sampling defaults."""

from __future__ import annotations

import pydantic
import pytest

from fastdeploy.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse
from fastdeploy.sampling_params import ParamValidationError, RequestOutputKind

MESSAGES = [{"role": "user", "content": "Hi"}]


def _param_of(exc: pydantic.ValidationError) -> str | None:
    cause = exc.errors()[0]["ctx"]["error"]
    assert isinstance(cause, ParamValidationError)
    return cause.parameter


def test_unknown_fields_are_accepted():
    request = CompletionRequest.model_validate({"prompt": "x", "not_a_field": 1, "another": {"a": 1}})
    assert request.prompt == "x"


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_forms(prompt):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompt == prompt


def test_null_max_tokens_means_16():
    assert CompletionRequest.model_validate({"prompt": "x", "max_tokens": None}).max_tokens == 16


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"prompt": "x", "logprobs": -3}, "logprobs"),
])
def test_completion_checks_name_the_parameter(body, param):
    with pytest.raises(pydantic.ValidationError) as info:
        CompletionRequest.model_validate(body)
    assert _param_of(info.value) == param


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": MESSAGES, "tools": []}, "tools"),
    ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
])
def test_chat_checks_name_the_parameter(body, param):
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert _param_of(info.value) == param


@pytest.mark.parametrize(("model", "base"), [
    (CompletionRequest, {"prompt": "x", "logprobs": 1}), (CompletionRequest, {"prompt": "x"}),
    (ChatCompletionRequest, {"messages": MESSAGES, "logprobs": True}), (ChatCompletionRequest, {"messages": MESSAGES}),
])
@pytest.mark.parametrize(("extra", "message"), [
    ({"logprob_token_ids": []}, "`logprob_token_ids` must not be an empty list."),
    ({"logprob_token_ids": [1], "use_beam_search": True}, "`logprob_token_ids` is not supported with beam search."),
])
def test_logprob_token_ids_checks(model, base, extra, message):
    with pytest.raises(pydantic.ValidationError, match=message) as info:
        model.model_validate({**base, **extra})
    assert _param_of(info.value) == "logprob_token_ids"


@pytest.mark.parametrize(("model", "body", "message"), [
    (CompletionRequest, {"prompt": "x"}, "when using `logprob_token_ids`, `logprobs` must be set."),
    (CompletionRequest, {"prompt": "x", "logprobs": 1, "echo": True, "max_tokens": 0},
     "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0`"),
    (ChatCompletionRequest, {"messages": MESSAGES, "logprobs": False},
     "when using `logprob_token_ids`, `logprobs` must be set to true."),
])
def test_logprob_token_ids_need_logprobs(model, body, message):
    with pytest.raises(pydantic.ValidationError, match=message) as info:
        model.model_validate({**body, "logprob_token_ids": [5]})
    assert _param_of(info.value) == "logprob_token_ids"


def test_logprob_token_ids_replace_the_logprobs_count():
    request = CompletionRequest.model_validate({"prompt": "x", "logprobs": 5, "logprob_token_ids": [4, 9]})
    params = request.sampling_params(3, {}, logprobs=request.logprobs, prompt_logprobs=None)
    assert params.logprob_token_ids == [4, 9] and params.logprobs is None and params.num_logprobs == 2
    # A list of something else is the field's own error (422-style detail, served as a 400).
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "logprobs": 1, "logprob_token_ids": "123"})


def test_stream_options_default_to_no_usage():
    options = CompletionRequest.model_validate({"prompt": "x", "stream": True, "stream_options": {}}).stream_options
    assert options.include_usage is False and options.continuous_usage_stats is False


def test_truncation_side_is_left_or_right():
    assert CompletionRequest.model_validate({"prompt": "x", "truncation_side": "right"}).truncation_side == "right"
    assert ChatCompletionRequest.model_validate({"messages": MESSAGES}).truncation_side is None
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "truncation_side": "middle"})


def test_tools_default_to_auto():
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert request.tool_choice == "auto"


def test_sampling_params_take_generation_config_defaults_unless_set():
    defaults = {"temperature": 0.3, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05}
    request = CompletionRequest.model_validate({"prompt": "x", "top_p": 0.5, "stream": True, "seed": 3})
    params = request.sampling_params(7, defaults, logprobs=2, prompt_logprobs=None)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (0.3, 0.5, 20, 1.05)
    assert params.max_tokens == 7 and params.logprobs == 2 and params.seed == 3
    assert params.output_kind == RequestOutputKind.DELTA
    plain = CompletionRequest.model_validate({"prompt": "x"}).sampling_params(5, {}, logprobs=None,
                                                                             prompt_logprobs=None)
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)
    assert plain.output_kind == RequestOutputKind.FINAL_ONLY


def test_sampling_params_validation_errors_keep_vllm_messages():
    request = CompletionRequest.model_validate({"prompt": "x", "temperature": -1})
    with pytest.raises(ParamValidationError, match="temperature must be non-negative, got -1.0.") as info:
        request.sampling_params(5, {}, logprobs=None, prompt_logprobs=None)
    assert info.value.parameter == "temperature"


def test_error_envelope_shape():
    error = ErrorResponse.model_validate({"error": {"message": "m", "type": "BadRequestError", "code": 400}})
    assert error.model_dump() == {"error": {"message": "m", "type": "BadRequestError", "param": None, "code": 400}}
