"""Structured outputs without a model: validation, cache keys, OpenAI fields, bitmask application, config."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fastdeploy.config import StructuredOutputsConfig
from fastdeploy.engine.arg_utils import EngineArgs
from fastdeploy.engine.sched.output import SchedulerOutput
from fastdeploy.model_executor.guided_decoding import (
    StructuredOutputOptions,
    get_structured_output_key,
    structured_outputs_from_openai,
    structured_outputs_from_request,
    validate_structured_outputs,
)
from fastdeploy.model_executor.guided_decoding.backend_xgrammar import (
    choice_as_grammar,
    grammar_is_likely_lark,
    has_xgrammar_unsupported_json_features,
)
from fastdeploy.model_executor.layers.sampler import Sampler, SamplingMetadata, apply_token_bitmask
from fastdeploy.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

SO = StructuredOutputsParams


# ---- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SO(json="{not json"), "Invalid JSON grammar specification."),
        (SO(json={"type": "foo"}), "Failed to transform json schema into a grammar"),
        (SO(json={"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}),
         "Failed to transform json schema into a grammar"),
        (SO(json={"type": "integer", "multipleOf": 3}), "features not supported by xgrammar"),
        (SO(json={"type": "array", "uniqueItems": True}), "features not supported by xgrammar"),
        (SO(json={"type": "string", "format": "credit-card"}), "features not supported by xgrammar"),
        (SO(json={"type": "string", "pattern": "a+", "maxLength": 3}), "features not supported by xgrammar"),
        (SO(regex="[a-z"), "Failed to transform regex into a grammar"),
        (SO(regex="(a|b"), "Failed to transform regex into a grammar"),
        (SO(regex="a\x00"), "NUL"),
        (SO(grammar='root ::= "a" | '), "Invalid grammar specification."),
        (SO(grammar="start: undefined_rule"), "Invalid grammar specification."),
        (SO(choice=[]), "non-empty list of strings"),
        (SO(structural_tag="{bad"), "Invalid structural tag specification."),
        (SO(json={"type": "object"}, whitespace_pattern=r"\s*"), "whitespace_pattern"),
        (SO(json_object=False), "json_object must be true"),
    ],
)
def test_invalid_constraints_are_value_errors(params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        validate_structured_outputs(params)


@pytest.mark.parametrize(
    "params",
    [
        SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
        SO(json='{"type": "array", "items": {"type": "string"}}'),
        SO(regex=r"\d{3}-[a-z]+"),
        SO(choice=['say "hi"', "back\\slash", "new\nline", "ünïcode"]),
        SO(grammar='root ::= "yes" | "no"'),
        SO(grammar='start: "yes" | "no"'),
        SO(json_object=True),
        SO(structural_tag=json.dumps({"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}],
                                      "triggers": ["<f>"]})),
    ],
)
def test_valid_constraints_pass_and_record_the_backend(params):
    validate_structured_outputs(params, StructuredOutputsConfig(backend="auto"))
    assert params._backend == "xgrammar" and params._backend_was_auto


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="only use one kind"):
        SO(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="none are specified"):
        SO()
    assert GuidedDecodingParams is StructuredOutputsParams
    # The legacy SamplingParams field moves into structured_outputs.
    sp = SamplingParams(guided_decoding=SO(regex="a"))
    assert sp.structured_outputs.regex == "a" and sp.guided_decoding is None


def test_choice_grammar_escapes_and_lark_detection():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    choices = ['say "hi"', "back\\slash", "new\nline", "ünïcode"]
    grammar = xgr.Grammar.from_ebnf(choice_as_grammar(choices))
    for choice in choices:
        assert _is_grammar_accept_string(grammar, choice)
    assert not _is_grammar_accept_string(grammar, "say hi")
    assert grammar_is_likely_lark("start: 'a'\n// rule ::= comment")
    assert not grammar_is_likely_lark('# lark?\nroot ::= "a"')


def test_unsupported_feature_walk_reaches_nested_schemas():
    nested = {"type": "object", "properties": {"a": {"type": "array", "items": [{"type": "number", "multipleOf": 2}]}}}
    assert has_xgrammar_unsupported_json_features(nested)
    assert not has_xgrammar_unsupported_json_features({"type": "string", "format": "date"})


# ---- cache keys ---------------------------------------------------------------------------
def test_cache_key_is_stable_across_spellings_and_keeps_property_order():
    as_dict = SO(json={"type": "object", "properties": {"b": {}, "a": {}}})
    as_text = SO(json='{"type":  "object", "properties": {"b": {}, "a": {}}}')
    key = get_structured_output_key(as_dict)
    assert key == get_structured_output_key(as_text)
    assert key.kind == StructuredOutputOptions.JSON and key.spec.index('"b"') < key.spec.index('"a"')
    assert key.any_whitespace
    compact = get_structured_output_key(SO(json={"type": "object"}, disable_any_whitespace=True))
    assert not compact.any_whitespace
    engine_wide = get_structured_output_key(SO(json={"type": "object"}), StructuredOutputsConfig(disable_any_whitespace=True))
    assert engine_wide == compact
    assert get_structured_output_key(SO(choice=["a", "b"])).kind == StructuredOutputOptions.CHOICE


# ---- OpenAI request fields ----------------------------------------------------------------
def test_openai_fields_to_params():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert structured_outputs_from_openai(response_format=rf).json == schema
    assert structured_outputs_from_openai(response_format={"type": "json_object"}).json_object is True
    assert structured_outputs_from_openai(response_format={"type": "text"}) is None
    assert structured_outputs_from_openai() is None
    assert structured_outputs_from_openai(guided_regex="a+").regex == "a+"
    assert structured_outputs_from_openai(guided_choice=["a", "b"]).choice == ["a", "b"]
    assert structured_outputs_from_openai(guided_grammar='root ::= "a"').grammar == 'root ::= "a"'
    assert structured_outputs_from_openai(guided_json=schema).json == schema
    assert structured_outputs_from_openai(structured_outputs={"regex": "b"}, guided_regex="a").regex == "b"
    tag = structured_outputs_from_openai(response_format={"type": "structural_tag", "format": {"type": "const_string", "value": "x"}})
    assert json.loads(tag.structural_tag)["type"] == "structural_tag"
    with pytest.raises(ValueError, match="only use one kind"):
        structured_outputs_from_openai(response_format={"type": "json_object"}, guided_regex="a")
    with pytest.raises(ValueError, match="json_schema.schema is required"):
        structured_outputs_from_openai(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(ValueError, match="response_format.type"):
        structured_outputs_from_openai(response_format={"type": "xml"})


def test_openai_request_models():
    from pydantic import BaseModel

    class JsonSchema(BaseModel):
        name: str
        schema_: dict

        model_config = {"populate_by_name": True}

    class Request(BaseModel):
        response_format: dict | None = None
        guided_choice: list[str] | None = None

    assert structured_outputs_from_request(Request(guided_choice=["x"])).choice == ["x"]
    assert structured_outputs_from_request(Request(response_format={"type": "json_object"})).json_object
    assert structured_outputs_from_request(object()) is None


# ---- bitmask application ------------------------------------------------------------------
def _bitmask(allowed: np.ndarray) -> np.ndarray:
    """xgrammar's layout: bit i of int32 word j is token 32 * j + i."""
    words = -(-allowed.shape[1] // 32)
    padded = np.zeros((allowed.shape[0], words * 32), dtype=bool)
    padded[:, : allowed.shape[1]] = allowed
    return np.packbits(padded, axis=-1, bitorder="little").view("<i4")


@pytest.mark.parametrize("numpy_only", [False, True], ids=["xgrammar-kernel", "numpy"])
def test_apply_token_bitmask_matches_xgrammar(numpy_only, monkeypatch):
    import torch
    import xgrammar as xgr

    from fastdeploy.model_executor.layers import sampler as sampler_module

    if numpy_only:
        monkeypatch.setattr(sampler_module, "_xgrammar_bitmask_kernel", lambda: None)

    rng = np.random.default_rng(0)
    vocab = 100
    allowed = rng.random((2, vocab)) < 0.3
    bitmask = _bitmask(allowed)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    ours = logits.copy()
    apply_token_bitmask(ours, bitmask, np.array([2, 0]))
    reference = torch.from_numpy(logits.copy())
    # xgrammar's indices address rows of a bitmask aligned with the logits.
    aligned = np.full((3, bitmask.shape[1]), -1, dtype=np.int32)
    aligned[[2, 0]] = bitmask
    xgr.apply_token_bitmask_inplace(reference, torch.from_numpy(aligned), indices=[2, 0])
    np.testing.assert_array_equal(ours, reference.numpy())
    np.testing.assert_array_equal(ours[1], logits[1])  # untouched row
    assert np.isneginf(ours[2][~allowed[0]]).all() and (ours[2][allowed[0]] == logits[2][allowed[0]]).all()


def test_sampler_never_picks_a_masked_token():
    rng = np.random.default_rng(1)
    vocab = 64
    allowed = np.zeros((2, vocab), dtype=bool)
    allowed[0, [3, 17]] = True
    allowed[1, [40]] = True
    logits = rng.standard_normal((2, vocab)).astype(np.float32) * 5
    for temperature in (0.0, 1.0):
        md = SamplingMetadata(temperature=np.full(2, temperature, dtype=np.float32), all_greedy=temperature == 0,
                              max_num_logprobs=2, grammar_bitmask=_bitmask(allowed), grammar_rows=np.arange(2))
        for _ in range(20):
            out = Sampler()(logits, md)
            assert out.sampled_token_ids[0] in (3, 17) and out.sampled_token_ids[1] == 40
            # Logprobs come from the masked distribution: the only allowed token of row 1 is certain.
            assert out.logprobs.logprobs[1, 0] == pytest.approx(0.0, abs=1e-6)


def test_scheduler_output_reorders_bitmask_rows():
    bitmask = np.arange(6, dtype=np.int32).reshape(3, 2)
    so = SchedulerOutput([], [], {}, 0, grammar_bitmask=bitmask, structured_output_request_ids={"a": 0, "b": 1, "c": 2})
    rows, positions = so.grammar_rows(["x", "c", "a"])
    np.testing.assert_array_equal(rows, bitmask[[2, 0]])
    np.testing.assert_array_equal(positions, [1, 2])
    assert so.grammar_rows(["x"]) == (None, None)
    assert SchedulerOutput([], [], {}, 0).grammar_rows(["a"]) == (None, None)


# ---- configuration ------------------------------------------------------------------------
def test_backend_selection():
    assert StructuredOutputsConfig().resolved_backend == "xgrammar"
    assert StructuredOutputsConfig.from_value({"backend": "xgrammar"}).backend == "xgrammar"
    with pytest.raises(ValueError, match="not built into FastDeploy; use 'xgrammar'"):
        StructuredOutputsConfig(backend="guidance")
    with pytest.raises(ValueError, match="Unknown structured outputs backend"):
        StructuredOutputsConfig(backend="magic")
    assert StructuredOutputsConfig(reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="'nope' not found in reasoning_parsers"):
        StructuredOutputsConfig(reasoning_parser="nope")
    with pytest.raises(ValueError, match="Unknown structured outputs config key"):
        StructuredOutputsConfig.from_value({"bakend": "xgrammar"})
    args = EngineArgs(guided_decoding_backend="xgrammar")
    assert args._structured_outputs_config().backend == "xgrammar"
    with pytest.raises(ValueError, match="outlines"):
        EngineArgs(guided_decoding_backend="outlines")._structured_outputs_config()
    merged = EngineArgs.from_kwargs(structured_outputs_config='{"disable_any_whitespace": true}')
    assert merged._structured_outputs_config().disable_any_whitespace
