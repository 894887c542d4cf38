"""The SmolLM2 tokenizer rebuilt from GGUF metadata: ids, specials, chat template, round trips."""

import os

import pytest

from fastdeploy.transformers_utils.model_resolver import resolve_model
from fastdeploy.transformers_utils.tokenizer import get_tokenizer

CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok():
    folder, gguf = resolve_model(None)
    return get_tokenizer(folder, gguf_file=gguf)


def test_special_tokens(tok):
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok.unk_token_id == 0 and tok.pad_token_id == 2
    assert len(tok) == 49152  # no extra tokens past the GGUF vocabulary
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tok.encode("<|im_start|>user<|im_end|>")[-1] == 2


def test_no_bos_is_added(tok):
    ids = tok.encode("Hello world")
    assert ids == [19556, 905]
    assert tok("Hello world")["input_ids"] == ids


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert tok.convert_ids_to_tokens(ids) == list("12345")


def test_chat_template(tok):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == CHAT
    ids = tok.encode(text)
    assert ids[:3] == [1, 9690, 198]
    assert ids.count(1) == 3 and ids.count(2) == 2
    assert max(ids) < 49152


@pytest.mark.parametrize(
    "text",
    [
        "Hello world 12345 héllo",
        "The year 2024 was great, wasn't it?\n\tdef f(x):\n        return x**2",
        "  leading spaces and trailing   ",
        "中文测试 日本語 한국어 🤗 emoji",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_folder_and_file_paths_find_the_gguf(tok):
    folder, gguf = resolve_model(None)
    by_file = get_tokenizer(os.path.join(folder, gguf))
    by_name = get_tokenizer("SmolLM2-135M-Instruct")
    text = "Paris is the capital of France."
    assert by_file.encode(text) == by_name.encode(text) == tok.encode(text)


def test_saved_tokenizer_folder_loads_the_same(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    again = get_tokenizer(str(tmp_path))
    assert again.encode(CHAT) == tok.encode(CHAT)
    assert again.eos_token_id == 2
