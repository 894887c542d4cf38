"""SamplingParams / StructuredOutputsParams / BeamSearchParams behave like vLLM's."""

import copy
import dataclasses
import pickle
import re

import msgspec
import pytest

from fastdeploy.engine.sampling_finalization import update_from_generation_config
from fastdeploy.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    ParamValidationError,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)


def _raises(message: str, **kwargs):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------- defaults


def test_defaults_match_vllm():
    sp = SamplingParams()
    assert sp.n == 1
    assert sp.presence_penalty == 0.0
    assert sp.frequency_penalty == 0.0
    assert sp.repetition_penalty == 1.0
    assert sp.temperature == 1.0
    assert sp.top_p == 1.0
    assert sp.top_k == 0
    assert sp.min_p == 0.0
    assert sp.seed is None
    assert sp.stop == []
    assert sp.stop_token_ids == []
    assert sp.bad_words == []
    assert sp.ignore_eos is False
    assert sp.max_tokens == 16
    assert sp.min_tokens == 0
    assert sp.logprobs is None
    assert sp.prompt_logprobs is None
    assert sp.detokenize is True
    assert sp.skip_special_tokens is True
    assert sp.spaces_between_special_tokens is True
    assert sp.include_stop_str_in_output is False
    assert sp.output_kind is RequestOutputKind.CUMULATIVE
    assert sp.structured_outputs is None
    assert sp.guided_decoding is None
    assert sp.logit_bias is None
    assert sp.allowed_token_ids is None
    assert sp.extra_args is None
    assert sp.truncate_prompt_tokens is None
    assert sp.all_stop_token_ids == set()
    assert sp.bad_words_token_ids is None
    assert sp.eos_token_id is None
    assert sp.sampling_type is SamplingType.RANDOM


def test_keyword_only():
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]


def test_max_tokens_none_allowed():
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_request_output_kind_values():
    assert RequestOutputKind.CUMULATIVE.value == 0
    assert RequestOutputKind.DELTA.value == 1
    assert RequestOutputKind.FINAL_ONLY.value == 2
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind is RequestOutputKind.DELTA


# ---------------------------------------------------------------- validation messages


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature must be non-negative, got -1.0."),
        ({"temperature": 2.5}, "temperature must be in [0, 2], got 2.5."),
        (
            {"temperature": float("nan")},
            "temperature must be a finite number, got nan.",
        ),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_k": -2}, "top_k must be 0 (disable), or at least 1, got -2."),
        ({"top_k": 1.5}, "top_k must be an integer, got float"),
        ({"min_p": 2}, "min_p must be in [0, 1], got 2."),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"temperature": 0, "n": 2}, "n must be 1 when using greedy sampling, got 2."),
        ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3."),
        ({"presence_penalty": -2.5}, "presence_penalty must be in [-2, 2], got -2.5."),
        ({"frequency_penalty": 3}, "frequency_penalty must be in [-2, 2], got 3."),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3."),
        (
            {"repetition_penalty": 0},
            "repetition_penalty must be greater than zero, got 0.",
        ),
        (
            {"repetition_penalty": -1.0},
            "repetition_penalty must be greater than zero, got -1.0.",
        ),
        (
            {"repetition_penalty": float("inf")},
            "repetition_penalty must be a finite number, got inf.",
        ),
        ({"stop": ["a", ""]}, "stop cannot contain an empty string."),
        ({"stop": ""}, "stop cannot contain an empty string."),
        (
            {"stop": "x", "detokenize": False},
            "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.",
        ),
        ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
        (
            {"max_tokens": 4, "min_tokens": 5},
            "min_tokens must be less than or equal to max_tokens=4, got 5.",
        ),
        ({"logprobs": -2}, "logprobs must be non-negative or -1, got -2."),
        (
            {"prompt_logprobs": -5},
            "prompt_logprobs must be non-negative or -1, got -5.",
        ),
        ({"logprob_token_ids": []}, "`logprob_token_ids` must not be an empty list."),
        (
            {"logprob_token_ids": list(range(129))},
            "Requested logprob_token_ids of length 129, which is greater than max allowed: 128",
        ),
        (
            {"logprob_token_ids": [1, 2], "logprobs": 3},
            "When both logprobs and logprob_token_ids are set, logprobs must equal len(logprob_token_ids). "
            "Got logprobs=3, len(logprob_token_ids)=2.",
        ),
        ({"n": 0}, "n must be at least 1, got 0."),
        ({"n": 1.5}, "n must be an int, but is of type <class 'float'>"),
        (
            {"stop_token_ids": [1, "2"]},
            "stop_token_ids must contain only integers, got [1, '2'].",
        ),
        (
            {"bad_words": ["ok", ""]},
            "bad_words cannot contain an empty string. Got bad_words=['ok', '']",
        ),
        (
            {"truncate_prompt_tokens": 0},
            "truncate_prompt_tokens must be an integer >= 1 or -1, got 0",
        ),
        (
            {"truncate_prompt_tokens": -2},
            "truncate_prompt_tokens must be an integer >= 1 or -1, got -2",
        ),
        ({"seed": 1.5}, "seed must be an integer, got float"),
        (
            {"logit_bias": {"abc": 1.0}},
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['abc']",
        ),
    ],
)
def test_validation_messages(kwargs, message):
    _raises(message, **kwargs)


def test_validation_error_names_parameter():
    with pytest.raises(ParamValidationError) as info:
        SamplingParams(top_p=0)
    assert info.value.parameter == "top_p"
    assert info.value.value == 0
    assert str(info.value) == "top_p must be in (0, 1], got 0."


def test_n_upper_bound(monkeypatch):
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    _raises(
        "n must be at most 4, got 5. To increase this limit, set the VLLM_MAX_N_SEQUENCES environment variable.",
        n=5,
    )
    assert SamplingParams(n=4).n == 4


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 2.0},
        {"top_p": 1.0},
        {"top_k": 1},
        {"top_k": -1},
        {"min_p": 1.0},
        {"min_p": 0.0},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0},
        {"logprobs": -1},
        {"prompt_logprobs": -1},
        {"logprobs": 0},
        {"logprob_token_ids": [3, 1], "logprobs": 2},
        {"truncate_prompt_tokens": -1},
        {"truncate_prompt_tokens": 1},
        {"max_tokens": 1, "min_tokens": 1},
        {"n": 3, "temperature": 0.7},
    ],
)
def test_boundary_values_accepted(kwargs):
    SamplingParams(**kwargs)


def test_num_logprobs_counts_the_ids_asked_for():
    assert SamplingParams().num_logprobs is None
    assert SamplingParams(logprobs=0).num_logprobs == 0
    assert SamplingParams(logprob_token_ids=[5, 6, 7]).num_logprobs == 3


# ---------------------------------------------------------------- normalisation


def test_stop_string_becomes_list():
    sp = SamplingParams(stop="###")
    assert sp.stop == ["###"]
    assert sp.output_text_buffer_length == 2
    assert SamplingParams(stop=("a", "bcd")).stop == ["a", "bcd"]


def test_output_text_buffer_not_needed_when_stop_included():
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_stop_token_ids_none_and_dedup():
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    sp = SamplingParams(stop_token_ids=[5, 3, 5, 1])
    assert sp.stop_token_ids == [5, 3, 1]
    assert sp.all_stop_token_ids == {1, 3, 5}


def test_bad_words_dedup():
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_seed_minus_one_is_none():
    sp = SamplingParams(seed=-1)
    assert sp.seed is None
    assert sp.sampling_type is SamplingType.RANDOM


def test_logprobs_true_is_one():
    sp = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert sp.logprobs == 1
    assert sp.prompt_logprobs == 1
    assert SamplingParams(logprobs=False).logprobs is None


def test_tiny_temperature_raised():
    sp = SamplingParams(temperature=1e-3)
    assert sp.temperature == 1e-2
    assert sp.sampling_type is SamplingType.RANDOM


def test_logit_bias_keys_int_and_clamped():
    sp = SamplingParams(logit_bias={"5": 150, 7: -250.5, "9": 3})
    assert sp.logit_bias == {5: 100.0, 7: -100.0, 9: 3.0}
    assert all(isinstance(k, int) for k in sp.logit_bias)


def test_logit_bias_bad_value():
    with pytest.raises(ValueError, match="logit_bias values must be numbers"):
        SamplingParams(logit_bias={1: "x"})


# ---------------------------------------------------------------- greedy / sampling type


def test_greedy_resets_truncation():
    sp = SamplingParams(temperature=0, top_p=0.5, top_k=10, min_p=0.3)
    assert sp.sampling_type is SamplingType.GREEDY
    assert sp.top_p == 1.0
    assert sp.top_k == 0
    assert sp.min_p == 0.0


def test_greedy_ignores_seed():
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY


def test_random_seed_sampling_type():
    assert SamplingParams(temperature=0.8, seed=42).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.8).sampling_type is SamplingType.RANDOM


def test_sampling_type_follows_changes():
    sp = SamplingParams(temperature=0.8)
    sp.temperature = 0.0
    assert sp.sampling_type is SamplingType.GREEDY


# ---------------------------------------------------------------- structured outputs


def test_structured_outputs_exactly_one():
    assert StructuredOutputsParams(json={"type": "object"}).json == {"type": "object"}
    with pytest.raises(
        ValueError,
        match=re.escape("You can only use one kind of structured outputs constraint but multiple are specified"),
    ):
        StructuredOutputsParams(json="{}", regex="a+")
    with pytest.raises(
        ValueError,
        match=re.escape("You must use one kind of structured outputs constraint but none are specified"),
    ):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="multiple are specified"):
        StructuredOutputsParams(choice=["a"], structural_tag="{}")


def test_structured_outputs_options():
    so = StructuredOutputsParams(choice=["yes", "no"], disable_any_whitespace=True, disable_fallback=True)
    assert so.choice == ["yes", "no"]
    assert so.disable_any_whitespace and so.disable_fallback
    assert not so.all_constraints_none()
    assert so.all_non_structural_tag_constraints_none() is False
    assert StructuredOutputsParams(structural_tag="{}").all_non_structural_tag_constraints_none()


def test_structured_outputs_from_optional():
    assert StructuredOutputsParams.from_optional(json=None, regex=None) is None
    assert StructuredOutputsParams.from_optional(regex="[0-9]+").regex == "[0-9]+"


def test_guided_decoding_alias():
    assert GuidedDecodingParams is StructuredOutputsParams
    so = GuidedDecodingParams(regex="a+")
    sp = SamplingParams(guided_decoding=so)
    # As in vLLM 0.11: the legacy field moves into structured_outputs.
    assert sp.structured_outputs is so
    assert sp.guided_decoding is None
    new = StructuredOutputsParams(grammar="root ::= 'x'")
    sp.structured_outputs = new
    # replace() keeps the current constraint.
    assert dataclasses.replace(sp, n=2).structured_outputs == new


def test_structured_outputs_from_dict():
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert isinstance(sp.structured_outputs, StructuredOutputsParams)
    assert sp.structured_outputs.choice == ["a", "b"]


# ---------------------------------------------------------------- misc API


def test_clone_is_deep():
    sp = SamplingParams(stop=["x"], stop_token_ids=[3], logit_bias={1: 2.0})
    update_from_generation_config(sp, {"eos_token_id": [9]}, 2)
    cp = sp.clone()
    assert cp == sp and cp is not sp
    cp.stop.append("y")
    cp.all_stop_token_ids.add(100)
    assert sp.stop == ["x"]
    assert 100 not in sp.all_stop_token_ids
    assert cp.eos_token_id == 2


def test_msgspec_roundtrip():
    sp = SamplingParams(
        temperature=0.5,
        stop="x",
        logit_bias={1: 2},
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=StructuredOutputsParams(choice=["a", "b"]),
    )
    update_from_generation_config(sp, {"eos_token_id": [3, 4]}, 3)
    for codec in (msgspec.msgpack, msgspec.json):
        back = codec.decode(codec.encode(sp), type=SamplingParams)
        assert back.structured_outputs == sp.structured_outputs
        assert back.output_kind is RequestOutputKind.DELTA
        assert back.stop == ["x"] and back.stop_token_ids == [4]
        assert back.logit_bias == {1: 2.0}


def test_pickle_and_copy_roundtrip():
    sp = SamplingParams(
        temperature=0.5,
        seed=1,
        stop="a",
        structured_outputs=StructuredOutputsParams(json_object=True),
    )
    update_from_generation_config(sp, {}, 7)
    for other in (pickle.loads(pickle.dumps(sp)), copy.copy(sp)):
        assert other == sp
        assert other.all_stop_token_ids == {7}
        assert other.eos_token_id == 7


def test_from_optional_none_means_default():
    sp = SamplingParams.from_optional(
        n=None,
        temperature=None,
        top_p=None,
        top_k=None,
        presence_penalty=None,
        max_tokens=None,
        stop="s",
    )
    assert sp.n == 1 and sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == 0
    assert sp.max_tokens is None
    assert sp.stop == ["s"]


def test_repr_concise():
    text = repr(SamplingParams(temperature=0.5, stop="x"))
    assert text.startswith("SamplingParams(n=1, ")
    assert "temperature=0.5" in text and "stop=['x']" in text
    assert "_all_stop_token_ids" not in text


def test_beam_search_params():
    bp = BeamSearchParams(beam_width=4, max_tokens=32)
    assert (
        bp.ignore_eos,
        bp.temperature,
        bp.length_penalty,
        bp.include_stop_str_in_output,
    ) == (False, 0.0, 1.0, False)
    assert BeamSearchParams(2, 8).beam_width == 2
    with pytest.raises(ValueError, match=re.escape("beam_width must be at least 1, got 0.")):
        BeamSearchParams(beam_width=0, max_tokens=8)
