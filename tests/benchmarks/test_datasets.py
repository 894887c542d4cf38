"""Benchmark datasets: lengths as vLLM defines them, seeds, filters, file formats."""

from __future__ import annotations

import argparse
import json

import pytest

from fastdeploy.benchmarks.datasets import (
    CustomDataset,
    PrefixRepetitionRandomDataset,
    RandomDataset,
    ShareGPTDataset,
    add_dataset_parser,
    get_samples,
    is_valid_sequence,
    load_json_list,
)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_random_fixed_lengths(tokenizer):
    requests = RandomDataset(seed=0).sample(tokenizer, 6, input_len=64, output_len=16)
    assert len(requests) == 6
    for r in requests:
        assert r.expected_output_len == 16
        # The prompt re-encodes to the requested length: what the server sees is what is reported.
        assert r.prompt_len == 64 == len(encode(tokenizer, r.prompt))
    # No special token (EOS, chat markers) sneaks into a random prompt.
    special = set(tokenizer.all_special_ids)
    assert not any(set(encode(tokenizer, r.prompt)) & special for r in requests)


def test_random_range_ratio_and_seed(tokenizer):
    requests = RandomDataset(seed=1).sample(tokenizer, 40, input_len=40, output_len=20, range_ratio=0.5)
    in_lens = [r.prompt_len for r in requests]
    out_lens = [r.expected_output_len for r in requests]
    assert min(in_lens) >= 20 and max(in_lens) <= 60 and len(set(in_lens)) > 5
    assert min(out_lens) >= 10 and max(out_lens) <= 30 and len(set(out_lens)) > 5
    again = RandomDataset(seed=1).sample(tokenizer, 40, input_len=40, output_len=20, range_ratio=0.5)
    assert [r.prompt for r in again] == [r.prompt for r in requests]
    other = RandomDataset(seed=2).sample(tokenizer, 40, input_len=40, output_len=20, range_ratio=0.5)
    assert [r.prompt for r in other] != [r.prompt for r in requests]
    with pytest.raises(ValueError, match="range_ratio"):
        RandomDataset().sample(tokenizer, 1, range_ratio=1.0)


def test_random_prefix_is_shared(tokenizer):
    requests = RandomDataset(seed=0).sample(tokenizer, 4, input_len=16, output_len=4, prefix_len=24)
    assert all(r.prompt_len == 40 for r in requests)
    prefixes = {tuple(encode(tokenizer, r.prompt)[:20]) for r in requests}
    assert len(prefixes) == 1


def test_prefix_repetition(tokenizer):
    requests = PrefixRepetitionRandomDataset(seed=0).sample(tokenizer, 6, prefix_len=32, suffix_len=16,
                                                            num_prefixes=2, output_len=8)
    assert len(requests) == 6 and all(r.expected_output_len == 8 for r in requests)
    assert all(44 <= r.prompt_len <= 52 for r in requests)
    starts = [tuple(encode(tokenizer, r.prompt)[:24]) for r in requests]
    # Two prefixes, each used by three requests.
    assert sorted(starts.count(s) for s in set(starts)) == [3, 3]
    with pytest.raises(ValueError, match="multiple"):
        PrefixRepetitionRandomDataset().sample(tokenizer, 5, num_prefixes=2)


def _sharegpt_entry(human: str, gpt: str) -> dict:
    return {"id": human[:8], "conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}]}


@pytest.fixture
def sharegpt_file(tmp_path):
    long_text = "word " * 1100
    data = [
        _sharegpt_entry("Tell me a story about a dragon and a knight.", "Once upon a time a dragon met a knight."),
        _sharegpt_entry("Hi", "Hello there, how can I help you today?"),  # prompt shorter than 4 tokens
        _sharegpt_entry("Explain how a rainbow forms in the sky.", "Ok."),  # answer shorter than 4 tokens
        _sharegpt_entry(long_text, "A reply that is long enough to count."),  # prompt over 1024 tokens
        {"id": "single", "conversations": [{"from": "human", "value": "Only one turn in this one."}]},
        _sharegpt_entry("What is the capital of France, and why?", "The capital of France is Paris, because."),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_loading_and_filtering(tokenizer, sharegpt_file):
    requests = ShareGPTDataset(str(sharegpt_file), seed=0).sample(tokenizer, 2)
    prompts = sorted(r.prompt for r in requests)
    assert prompts == ["Tell me a story about a dragon and a knight.", "What is the capital of France, and why?"]
    for r in requests:
        assert r.prompt_len == len(encode(tokenizer, r.prompt))
    with pytest.raises(ValueError, match="only 2 usable"):
        ShareGPTDataset(str(sharegpt_file)).sample(tokenizer, 3)
    # A fixed output length skips the answer-length filter: the "Ok." entry becomes usable.
    fixed = ShareGPTDataset(str(sharegpt_file)).sample(tokenizer, 3, output_len=7)
    assert all(r.expected_output_len == 7 for r in fixed)


def test_truncated_json_keeps_complete_entries(tmp_path):
    full = json.dumps([{"a": 1}, {"b": [2, 3]}, {"c": "text"}])
    path = tmp_path / "cut.json"
    path.write_text(full[: full.index('"text"') + 3])
    assert load_json_list(str(path)) == [{"a": 1}, {"b": [2, 3]}]
    path.write_text(full)
    assert len(load_json_list(str(path))) == 3


def test_is_valid_sequence():
    assert is_valid_sequence(10, 10)
    assert not is_valid_sequence(3, 10) and not is_valid_sequence(10, 3)
    assert is_valid_sequence(10, 3, skip_min_output_len_check=True)
    assert not is_valid_sequence(1025, 10) and not is_valid_sequence(1000, 1049)


def test_custom_jsonl(tokenizer, tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Question number {i}?"}) for i in range(3)) + "\n")
    plain = CustomDataset(str(path)).sample(tokenizer, 2, output_len=5, skip_chat_template=True)
    assert [r.prompt for r in plain] == ["Question number 0?", "Question number 1?"]
    assert all(r.expected_output_len == 5 for r in plain)
    chat = CustomDataset(str(path)).sample(tokenizer, 1)
    assert "Question number 0?" in chat[0].prompt and chat[0].prompt != "Question number 0?"
    assert chat[0].expected_output_len == 256 and chat[0].prompt_len == len(encode(tokenizer, chat[0].prompt))
    with pytest.raises(ValueError, match="3 prompts"):
        CustomDataset(str(path)).sample(tokenizer, 4)
    with pytest.raises(ValueError, match="dataset-path"):
        CustomDataset("")


def test_get_samples_from_flags(tokenizer, sharegpt_file):
    parser = argparse.ArgumentParser()
    add_dataset_parser(parser)
    args = parser.parse_args(["--num-prompts", "3", "--random-input-len", "12", "--random-output-len", "5"])
    assert args.dataset_name == "random"
    assert [(r.prompt_len, r.expected_output_len) for r in get_samples(args, tokenizer)] == [(12, 5)] * 3
    args = parser.parse_args(["--dataset-name", "sharegpt", "--dataset-path", str(sharegpt_file),
                              "--num-prompts", "1"])
    assert len(get_samples(args, tokenizer)) == 1
