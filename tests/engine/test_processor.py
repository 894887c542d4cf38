"""The one intake: a prompt is tokenized, truncated and checked once, its parameters finalized once."""

import pytest

from fastdeploy.engine.arg_utils import EngineArgs
from fastdeploy.engine.processor import ProcessedPrompt, Processor
from fastdeploy.sampling_params import ParamValidationError, SamplingParams
from fastdeploy.transformers_utils.tokenizer import get_tokenizer_for_model
from tests.call_counter import count_calls


@pytest.fixture(scope="module")
def processor():
    config = EngineArgs(max_model_len=64).create_engine_config().model_config
    return Processor(config, get_tokenizer_for_model(config))


@pytest.fixture
def calls(processor, monkeypatch):
    """Counts the intake steps a request goes through."""
    return count_calls(monkeypatch, processor, ("tokenize_prompt", "validate_prompt", "finalize_params"))


def test_n_children_share_one_check_and_one_finalization(processor, calls):
    params = SamplingParams(n=3, seed=5, temperature=0.8, max_tokens=4, bad_words=["Paris"])
    processed = processor.process_request("r", "What is the capital of France?", params)
    assert calls == {"tokenize_prompt": 1, "validate_prompt": 1, "finalize_params": 1}
    specs = processed.engine_requests
    assert [s.core_request.request_id for s in specs] == ["0_r", "1_r", "2_r"]
    assert [s.core_request.sampling_params.seed for s in specs] == [5, 6, 7]
    assert all(s.parent is specs[0].parent and s.parent.n == 3 for s in specs)
    # Every child carries the finalized parameters (EOS id, tokenized bad words), not the caller's object.
    assert all(s.core_request.eos_token_id == 2 and s.core_request.bad_words_token_ids for s in specs)
    assert params.bad_words_token_ids is None and params.n == 3


def test_a_processed_prompt_is_not_checked_again(processor, calls):
    prompt = processor.process_prompt("Hello there", truncate_prompt_tokens=2, leave_room=True)
    assert len(prompt.token_ids) == 2 and calls == {"tokenize_prompt": 1, "validate_prompt": 1}
    processed = processor.process_request("r", prompt, SamplingParams(max_tokens=3, truncate_prompt_tokens=1))
    assert processed.prompt is prompt and processed.engine_requests[0].core_request.prompt_token_ids == prompt.token_ids
    assert calls == {"tokenize_prompt": 1, "validate_prompt": 1, "finalize_params": 1}


def test_truncation_and_the_two_length_rules(processor):
    ids = list(range(10, 80))  # 70 tokens, past max_model_len=64
    assert processor.process_prompt({"prompt_token_ids": ids}, truncate_prompt_tokens=5).token_ids == ids[-5:]
    assert processor.process_prompt({"prompt_token_ids": ids}, truncate_prompt_tokens=-1).token_ids == ids[-64:]
    # Offline a prompt may fill the context; the server wants room for one generated token (vLLM's wording each).
    assert len(processor.process_prompt({"prompt_token_ids": ids[:64]}).token_ids) == 64
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        processor.process_prompt({"prompt_token_ids": ids[:64]}, leave_room=True)
    with pytest.raises(ValueError, match=r"decoder prompt \(length 70\) is longer than the maximum model length"):
        processor.process_request("r", {"prompt_token_ids": ids}, SamplingParams())
    with pytest.raises(ValueError, match="cannot be empty"):
        processor.process_prompt({"prompt_token_ids": ids}, truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="out of vocabulary"):
        processor.process_prompt({"prompt_token_ids": [1, 10**6]})
    assert isinstance(processor.process_prompt("x"), ProcessedPrompt)


def test_truncation_side_left_by_default_right_on_request(processor):
    ids = list(range(10, 30))
    # The tokenizer is loaded with vLLM's side for generation: the end of a long prompt is kept.
    assert processor.tokenizer.truncation_side == "left"
    assert processor.process_prompt({"prompt_token_ids": ids}, truncate_prompt_tokens=4).token_ids == ids[-4:]
    assert processor.process_prompt({"prompt_token_ids": ids}, truncate_prompt_tokens=4,
                                    truncation_side="right").token_ids == ids[:4]
    text = processor.process_prompt("one two three four five six", truncate_prompt_tokens=2, truncation_side="right")
    assert text.token_ids == processor.tokenizer.encode("one two three four five six")[:2]
    with pytest.raises(ValueError, match="truncation_side must be 'left' or 'right'"):
        processor.process_prompt({"prompt_token_ids": ids}, truncate_prompt_tokens=4, truncation_side="middle")


def test_whole_vocabulary_logprobs_count_as_the_vocabulary_against_max_logprobs(processor):
    """vLLM's rule: -1 means the vocabulary size, refused with the default --max-logprobs 20."""
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        with pytest.raises(ParamValidationError, match=f"Requested {kind} logprobs of 49152, which is greater than "
                                                       "max allowed: 20") as info:
            processor.finalize_params(SamplingParams(**{name: -1}))
        assert info.value.parameter == name
        processor.finalize_params(SamplingParams(**{name: 20}))
    with pytest.raises(ParamValidationError, match=r"token_id\(s\) \[49152\] in logprob_token_ids contain "
                                                   "out-of-vocab token ids. Vocabulary size: 49152"):
        processor.finalize_params(SamplingParams(logprob_token_ids=[0, 49152]))


def test_whole_vocabulary_logprobs_with_max_logprobs_minus_one():
    config = EngineArgs(max_model_len=64, max_logprobs=-1).create_engine_config().model_config
    Processor(config, None).finalize_params(SamplingParams(logprobs=-1, prompt_logprobs=-1))


def test_a_text_too_long_for_the_context_is_refused_before_tokenizing(processor, calls, monkeypatch):
    # SmolLM2's longest vocabulary entry spells 81 characters: 64 tokens hold at most 64 * 81 of them.
    bound = processor.max_prompt_chars
    assert 64 * 81 <= bound < 64 * 81 * 4
    encoded = []
    monkeypatch.setattr(processor.tokenizer, "encode", lambda text, **kw: encoded.append(text) or [1])
    with pytest.raises(ValueError, match=f"has {bound + 1} characters, more than 64 tokens can spell"):
        processor.process_prompt("x" * (bound + 1), leave_room=True)
    with pytest.raises(ValueError, match="characters"):
        processor.process_request("r", {"prompt": "x" * (bound + 1)}, SamplingParams())
    assert encoded == []
    # A text at the bound is tokenized; a truncated prompt may be any length (only its tail is kept).
    processor.process_prompt("x" * bound)
    processor.process_prompt("x" * (bound + 1), truncate_prompt_tokens=8)
    assert len(encoded) == 2


def test_bad_words_without_a_tokenizer_are_refused_not_dropped():
    config = EngineArgs(max_model_len=64, skip_tokenizer_init=True).create_engine_config().model_config
    processor = Processor(config, None)
    with pytest.raises(ParamValidationError, match="bad_words needs a tokenizer") as info:
        processor.process_request("r", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2, bad_words=["x"]))
    assert info.value.parameter == "bad_words"
    # Without bad words the same request is accepted.
    assert processor.process_request("r", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2)).engine_requests
