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


def _byte_level_gguf(path, pre):
    """A vocabulary-only deepseek2 GGUF file: the 256 byte-level tokens, two merges, DeepSeek's BOS / EOS."""
    import gguf
    from tokenizers.pre_tokenizers import ByteLevel

    tokens = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", *sorted(ByteLevel.alphabet()), "12", "123"]
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    w.add_token_merges(["1 2", "12 3"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return tokens


@pytest.mark.parametrize(
    "pre, pieces",
    [
        # DeepSeek-V3: digits in threes, a CJK run on its own, punctuation glued to the letters after it.
        ("deepseek-v3", ["1234567", ["123", "456", "7"]]),
        ("deepseek-v3", ["中文abc def", ["中文", "abc", " def"]]),
        ("deepseek-v3", ["x.y", ["x", ".y"]]),
        # DeepSeek-LLM / V2: one run of digits, letters with their leading space, newline on its own.
        ("deepseek-llm", ["1234567", ["1234567"]]),
        ("deepseek-llm", ["Hello world\nx", ["Hello", " world", "\n", "x"]]),
    ],
)
def test_deepseek_pre_tokenizers_split_as_llama_cpp(tmp_path, pre, pieces):
    """tokenizer.ggml.pre "deepseek-v3" / "deepseek-llm" (deepseek2 GGUF files): llama.cpp's regex sequence."""
    from tokenizers import pre_tokenizers

    from fastdeploy.transformers_utils.tokenizer import build_gguf_bpe_tokenizer

    text, want = pieces
    tokens = _byte_level_gguf(tmp_path / "vocab.gguf", pre)
    tok = build_gguf_bpe_tokenizer(str(tmp_path / "vocab.gguf"))
    got = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    assert got == [byte_level.pre_tokenize_str(p)[0][0] for p in want]
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.bos_token == tokens[0] and tok.eos_token_id == 1  # the file's add_bos_token
    assert tok.decode(ids, skip_special_tokens=True) == text
    if pre == "deepseek-v3" and text == "1234567":
        assert tok.convert_ids_to_tokens(ids[1:]) == ["123", "4", "5", "6", "7"]  # merges within each group
