"""The engine's finalization of SamplingParams against the model: EOS ids, bad words, token-id ranges (vLLM's)."""

import re

import pytest

from fastdeploy.engine.sampling_finalization import (
    update_from_generation_config,
    update_from_tokenizer,
    verify_token_ids,
)
from fastdeploy.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    """A small byte-level BPE tokenizer trained in-process (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "hello world",
        "say hello to the world",
        "the quick brown fox",
        "hello hello world world",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


# ---------------------------------------------------------------- generation config


def test_update_from_generation_config_adds_eos():
    sp = SamplingParams(stop_token_ids=[7])
    update_from_generation_config(sp, {"eos_token_id": [2, 9, 11]}, 2)
    assert sp.eos_token_id == 2
    # The primary EOS is handled separately and is not a stop token id.
    assert sp.stop_token_ids == [7, 9, 11]
    assert sp.all_stop_token_ids == {2, 7, 9, 11}


def test_update_from_generation_config_int_eos():
    sp = SamplingParams()
    update_from_generation_config(sp, {"eos_token_id": 4}, 2)
    assert sp.stop_token_ids == [4]
    assert sp.all_stop_token_ids == {2, 4}


def test_update_from_generation_config_same_eos():
    sp = SamplingParams()
    update_from_generation_config(sp, {"eos_token_id": 2}, eos_token_id=2)
    assert sp.stop_token_ids == []
    assert sp.all_stop_token_ids == {2}
    assert sp.eos_token_id == 2


def test_update_from_generation_config_ignore_eos():
    sp = SamplingParams(ignore_eos=True)
    update_from_generation_config(sp, {"eos_token_id": [2, 9]}, 2)
    assert sp.eos_token_id is None
    assert sp.stop_token_ids == []
    # min_tokens still masks every EOS id.
    assert sp.all_stop_token_ids == {2, 9}


def test_update_from_generation_config_no_eos():
    sp = SamplingParams()
    update_from_generation_config(sp, {}, None)
    assert sp.eos_token_id is None
    assert sp.all_stop_token_ids == set()


# ---------------------------------------------------------------- tokenizer


def test_bad_words_with_and_without_space(tokenizer):
    sp = SamplingParams(bad_words=["hello", "world", " zebra"])
    update_from_tokenizer(sp, tokenizer)

    def enc(text):
        return tokenizer.encode(text, add_special_tokens=False)

    # "hello" and " hello" are distinct single tokens: both are blocked.
    # "world" / " world" and "zebra" / " zebra" differ in length: only the bare form.
    assert sp.bad_words_token_ids == [
        enc("hello"),
        enc(" hello"),
        enc("world"),
        enc("zebra"),
    ]
    assert enc("hello") != enc(" hello")


def test_bad_words_empty_after_tokenization():
    class Empty:
        max_token_id = 10

        def encode(self, text, add_special_tokens=False):
            return []

    sp = SamplingParams(bad_words=["x"])
    with pytest.raises(
        ValueError,
        match=re.escape("bad_words entries must tokenize to at least one token."),
    ):
        update_from_tokenizer(sp, Empty())


def test_bad_words_out_of_vocab():
    class Big:
        max_token_id = 10

        def encode(self, text, add_special_tokens=False):
            return [42]

    sp = SamplingParams(bad_words=["x"])
    with pytest.raises(
        ValueError,
        match=re.escape(
            "The model vocabulary size is 11, but the following tokens were specified as bad: [42]. "
            "All token id values should be integers satisfying: 0 <= token_id <= 10."
        ),
    ):
        update_from_tokenizer(sp, Big())


def test_too_many_bad_words(monkeypatch, tokenizer):
    monkeypatch.setenv("VLLM_MAX_NUM_BAD_WORDS", "1")
    sp = SamplingParams(bad_words=["hello"])
    with pytest.raises(
        ValueError,
        match=re.escape("Too many bad words after tokenization: 2. The max number is 1."),
    ):
        update_from_tokenizer(sp, tokenizer)


def test_no_bad_words_leaves_none(tokenizer):
    sp = SamplingParams()
    update_from_tokenizer(sp, tokenizer)
    assert sp.bad_words_token_ids is None


def test_allowed_token_ids_checked(tokenizer):
    vocab = len(tokenizer)
    update_from_tokenizer(SamplingParams(allowed_token_ids=[0, vocab - 1]), tokenizer)
    with pytest.raises(ValueError, match=re.escape("allowed_token_ids contains out-of-vocab token id!")):
        update_from_tokenizer(SamplingParams(allowed_token_ids=[0, vocab]), tokenizer)
    with pytest.raises(ValueError, match=re.escape("allowed_token_ids is not None and empty!")):
        update_from_tokenizer(SamplingParams(allowed_token_ids=[]), tokenizer)


def test_logit_bias_checked(tokenizer):
    vocab = len(tokenizer)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"token_id(s) [{vocab + 5}] in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}"
        ),
    ):
        update_from_tokenizer(SamplingParams(logit_bias={vocab + 5: 1.0}), tokenizer)
    # A model vocabulary larger than the tokenizer's (padded embeddings) widens the range.
    update_from_tokenizer(SamplingParams(logit_bias={vocab + 5: 1.0}), tokenizer, vocab_size=vocab + 64)


def test_stop_token_ids_checked():
    with pytest.raises(
        ValueError,
        match=re.escape("token_id(s) [-1, 50] in stop_token_ids contain out-of-vocab token ids. Vocabulary size: 50"),
    ):
        verify_token_ids(SamplingParams(stop_token_ids=[3, -1, 50]), 50)
