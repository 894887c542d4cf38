"""ngram speculation on the default model: text-repeating prompts and structured outputs."""

import json

import pytest

from fastdeploy import LLM, SamplingParams, StructuredOutputsParams

CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef sub(a, b):\n    return a - b\n"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "items": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
          "required": ["name", "items"]}


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(max_model_len=2048, kv_cache_memory_bytes=128 << 20, max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4})


def _chat(llm, text):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)


def test_copying_prompt_is_identical_and_mostly_accepted(spec_llm, smol_llm):
    prompts = [_chat(spec_llm, "Repeat this code exactly:\n" + CODE), _chat(spec_llm, "What is 2 + 2?")]
    params = SamplingParams(temperature=0, max_tokens=48)
    before = spec_llm.llm_engine.spec_decode_totals.stats.num_draft_tokens
    spec = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)]
    assert spec == [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    totals = spec_llm.llm_engine.spec_decode_totals
    assert totals.stats.num_draft_tokens > before
    assert totals.acceptance_rate > 0.3, totals.stats


def test_structured_outputs_validate_with_speculation(spec_llm, smol_llm):
    prompts = [_chat(spec_llm, "Give a JSON object with name 'fruit list' and items apple, banana, apple, banana."),
               _chat(spec_llm, "Return JSON: name Bob, items: red, green, blue, red.")]
    params = SamplingParams(temperature=0, max_tokens=150, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    before = spec_llm.llm_engine.spec_decode_totals.stats.num_drafts
    spec = spec_llm.generate(prompts, params)
    # The grammar let some drafts through to verification.
    assert spec_llm.llm_engine.spec_decode_totals.stats.num_drafts > before
    plain = smol_llm.generate(prompts, params)
    for a, b in zip(spec, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].finish_reason == "stop"
        value = json.loads(a.outputs[0].text)
        assert set(value) == {"name", "items"} and len(value["items"]) <= 4


@pytest.mark.parametrize("setting", [{"repetition_penalty": 1.1}, {"presence_penalty": 0.5},
                                     {"frequency_penalty": 0.3}, {"min_tokens": 40},
                                     {"bad_words": ["mul", "x - y"]}], ids=lambda s: next(iter(s)))
def test_output_dependent_settings_copy_with_drafts_accepted(spec_llm, smol_llm, setting):
    """Penalties, min_tokens and bad words: greedy output as without speculation, drafts still accepted.

    The second prompt's greedy answer ends (EOS) well before 40 tokens on every attention path
    (23-30 tokens), so min_tokens=40 changes it."""
    prompts = [_chat(spec_llm, "Repeat this code exactly:\n" + CODE), _chat(spec_llm, "Is water wet? Answer yes or no.")]
    params = SamplingParams(temperature=0, max_tokens=48, **setting)
    plain = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, params)]
    unset = [o.outputs[0].token_ids for o in smol_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48))]
    assert plain != unset  # the setting bites
    stats = spec_llm.llm_engine.spec_decode_totals.stats
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    assert [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params)] == plain
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted > 0 and accepted / drafted > 0.15, (drafted, accepted)
