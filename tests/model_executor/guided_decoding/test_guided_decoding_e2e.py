"""Structured outputs end to end on SmolLM2 through ``LLM``: every output obeys its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from fastdeploy import SamplingParams, StructuredOutputsParams
from tests.model_executor.guided_decoding.schemas import SCHEMAS

pytestmark = pytest.mark.slow


def chat(llm, text: str) -> dict:
    """A chat prompt as token ids (the template already holds the special tokens)."""
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return {"prompt_token_ids": list(ids)}


def test_twenty_json_schemas_in_one_batch(smol_llm):
    prompts = [chat(smol_llm, f"Reply with JSON describing {what}.") for what, _ in SCHEMAS]
    # Compact JSON: a 135M model can otherwise wander in whitespace the grammar allows.
    params = [
        SamplingParams(temperature=0, max_tokens=96,
                       structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
        for _, schema in SCHEMAS
    ]
    outputs = smol_llm.generate(prompts, params, use_tqdm=False)
    assert len(SCHEMAS) == 20
    for (what, schema), out in zip(SCHEMAS, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (what, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_with_default_whitespace_and_sampling(smol_llm):
    schema = SCHEMAS[0][1]
    prompts = [chat(smol_llm, "Give me a person as JSON.")] * 3
    params = [SamplingParams(temperature=t, seed=s, max_tokens=96, structured_outputs=StructuredOutputsParams(json=schema))
              for t, s in ((0.0, None), (0.8, 1), (0.8, 2))]
    for out in smol_llm.generate(prompts, params, use_tqdm=False):
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_json_object(smol_llm):
    prompt = chat(smol_llm, 'Reply with a JSON object like {"name": "Tom", "age": 3} for a cat.')
    for compact in (True, False):
        sp = SamplingParams(temperature=0, max_tokens=96,
                            structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=compact))
        out = smol_llm.generate([prompt], sp, use_tqdm=False)
        assert isinstance(json.loads(out[0].outputs[0].text), dict)


REGEXES = [
    r"\d{3}-\d{4}",
    r"(red|green|blue)",
    r"[A-Z][a-z]{2,6}",
    r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"(true|false)",
]


def test_regex_outputs_fully_match(smol_llm):
    prompts = [chat(smol_llm, q) for q in ("Phone number?", "A color?", "A name?", "A date?", "An email?", "True?")]
    params = [SamplingParams(temperature=0, max_tokens=32, structured_outputs=StructuredOutputsParams(regex=r))
              for r in REGEXES]
    params[2] = SamplingParams(temperature=1.0, seed=7, max_tokens=32,
                               structured_outputs=StructuredOutputsParams(regex=REGEXES[2]))
    for regex, out in zip(REGEXES, smol_llm.generate(prompts, params, use_tqdm=False), strict=True):
        assert re.fullmatch(regex, out.outputs[0].text), (regex, out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop"


def test_choice_and_grammar(smol_llm):
    choices = ["positive", "negative", "neutral"]
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    prompts = [chat(smol_llm, "Classify: I love this movie!"), chat(smol_llm, "Is water wet?")]
    params = [
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(grammar=grammar)),
    ]
    choice_out, grammar_out = smol_llm.generate(prompts, params, use_tqdm=False)
    assert choice_out.outputs[0].text in choices
    assert re.fullmatch(r"The answer is (yes|no)\.", grammar_out.outputs[0].text)
    # Each sampled choice, over several seeds, is still one of the choices.
    sampled = SamplingParams(temperature=1.0, n=4, seed=3, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=choices))
    out = smol_llm.generate([chat(smol_llm, "Pick a sentiment.")], sampled, use_tqdm=False)[0]
    assert all(c.text in choices for c in out.outputs)


def test_unconstrained_neighbours_are_unaffected(smol_llm):
    free_prompts = [chat(smol_llm, q) for q in ("Tell me about the moon.", "What is 2 + 2?", "Name a fruit.")]
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = smol_llm.generate(free_prompts, free, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=0, max_tokens=24,
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[0][1], disable_any_whitespace=True)),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex=r"\d+")),
    ]
    mixed = smol_llm.generate(
        [free_prompts[0], chat(smol_llm, "JSON person"), free_prompts[1], chat(smol_llm, "A number"), free_prompts[2]],
        [free, constrained[0], free, constrained[1], free],
        use_tqdm=False,
    )
    for solo, together in zip(alone, [mixed[0], mixed[2], mixed[4]], strict=True):
        assert together.outputs[0].token_ids == solo.outputs[0].token_ids
    assert re.fullmatch(r"\d+", mixed[3].outputs[0].text)


@pytest.mark.parametrize(
    "constraint",
    [
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
        StructuredOutputsParams(json="{broken"),
        StructuredOutputsParams(regex="(unclosed"),
        StructuredOutputsParams(grammar="root ::= ("),
    ],
    ids=["schema", "json-text", "regex", "grammar"],
)
def test_invalid_constraint_is_a_value_error_and_the_engine_keeps_working(smol_llm, constraint):
    good = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError):
        smol_llm.generate(["Hello", "Hi"], [good, SamplingParams(max_tokens=4, structured_outputs=constraint)],
                          use_tqdm=False)
    assert not smol_llm.llm_engine.has_unfinished_requests()
    out = smol_llm.generate(["Hello"], good, use_tqdm=False)
    assert out[0].outputs[0].finish_reason in ("stop", "length") and out[0].outputs[0].token_ids
