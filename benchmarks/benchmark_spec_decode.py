"""Speculative decoding: TPOT with and without each method, at one stream and 16 streams. Writes JSON.

Two workloads on the default model (greedy, so every configuration produces the same tokens):

- ``copy``: chat prompts asking to repeat a piece of code taken from this repository's own
  sources, answers that copy their prompt (where prompt lookup shines);
- ``random``: random token prompts with ``ignore_eos`` answers (where drafts rarely hit, so
  the cost of proposing and verifying shows).

Requests are driven through the engine step by step with a closed loop of ``streams`` in flight;
each token's arrival time gives TTFT and TPOT per request. Per configuration: median / mean
TPOT, output tokens/s, and the acceptance rate overall and per draft position.

    python benchmarks/benchmark_spec_decode.py --methods none,ngram,suffix --streams 1,16 --num-prompts 8
    python benchmarks/benchmark_spec_decode.py --draft-model /path/to/small-model   # adds draft_model
    python benchmarks/benchmark_spec_decode.py -q none --output benchmarks/results/spec_decode_bf16.json
    python benchmarks/benchmark_spec_decode.py --methods none,ngram --repetition-penalty 1.05   # penalised requests
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import statistics
import time

import numpy as np


def copy_prompts(tokenizer, num: int, lines: int, seed: int) -> list[list[int]]:
    """Chat prompts 'repeat this code' over ``lines``-line pieces of the repository's Python files."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fastdeploy")
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    rng = np.random.default_rng(seed)
    prompts = []
    while len(prompts) < num:
        source = open(files[int(rng.integers(len(files)))], encoding="utf-8").read().splitlines()
        if len(source) < lines:
            continue
        start = int(rng.integers(len(source) - lines + 1))
        snippet = "\n".join(source[start : start + lines])
        chat = [{"role": "user", "content": "Repeat this code exactly, without any comment:\n\n" + snippet}]
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(100, vocab, size=(num, length)).tolist()


def drive(llm, prompts: list[list[int]], params, streams: int) -> dict:
    """Run ``prompts`` with ``streams`` in flight; per-request TTFT / TPOT from token arrival times."""
    engine = llm.llm_engine
    pending = list(enumerate(prompts))
    start: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}
    in_flight = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < streams:
            i, prompt = pending.pop(0)
            rid = f"req-{i}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            start[rid] = time.perf_counter()
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in first:
                first[out.request_id] = now
            if n:
                last[out.request_id] = now
                counts[out.request_id] = n
            if out.finished:
                in_flight -= 1
    elapsed = time.perf_counter() - t0
    tpot = [(last[r] - first[r]) / (counts[r] - 1) for r in counts if counts[r] > 1]
    ttft = [first[r] - start[r] for r in first]
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens": sum(counts.values()),
        "output_tokens_per_s": round(sum(counts.values()) / elapsed, 2),
        "median_tpot_ms": round(1000 * statistics.median(tpot), 2),
        "mean_tpot_ms": round(1000 * statistics.fmean(tpot), 2),
        "median_ttft_ms": round(1000 * statistics.median(ttft), 2),
    }


def spec_config(method: str, k: int, draft_model: str | None) -> dict | None:
    if method == "none":
        return None
    config = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        config.update(prompt_lookup_min=2, prompt_lookup_max=4)
    if method == "draft_model":
        config["model"] = draft_model
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="none,ngram,suffix", help="comma-separated: none, ngram, suffix, draft_model")
    parser.add_argument("--draft-model", default=None, help="draft checkpoint (adds draft_model to the methods)")
    parser.add_argument("--streams", default="1,16")
    parser.add_argument("--workloads", default="copy,random")
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts per (workload, streams) run")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--copy-lines", type=int, default=12)
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="vLLM's disable_by_batch_size for the speculative runs")
    parser.add_argument("--seed", type=int, default=0)
    # Penalised requests speculate too (each verified position sees the drafts before it as outputs).
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--quantization", "-q", default=None,
                        help="the engine's --quantization (default: the GGUF file's blocks; 'none' dequantizes)")
    parser.add_argument("--output", default="benchmarks/results/spec_decode.json")
    args = parser.parse_args()

    from fastdeploy import LLM, SamplingParams

    methods = args.methods.split(",")
    if args.draft_model and "draft_model" not in methods:
        methods.append("draft_model")
    streams_list = [int(s) for s in args.streams.split(",")]
    results = []
    workloads: dict[str, list[list[int]]] = {}
    for method in methods:
        config = spec_config(method, args.num_speculative_tokens, args.draft_model)
        if config is not None and args.disable_by_batch_size:
            config["disable_by_batch_size"] = args.disable_by_batch_size
        llm = LLM(max_model_len=2048, max_num_seqs=max(streams_list), kv_cache_memory_bytes=1 << 30,
                  speculative_config=config, quantization=args.quantization)
        if not workloads:
            tok = llm.get_tokenizer()
            workloads = {"copy": copy_prompts(tok, args.num_prompts, args.copy_lines, args.seed),
                         "random": random_prompts(args.num_prompts, args.random_input_len, len(tok), args.seed)}
        for workload in args.workloads.split(","):
            params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=workload == "random",
                                    repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty)
            # Warm-up (kernels, first allocations), not measured.
            llm.generate([{"prompt_token_ids": workloads[workload][0]}], SamplingParams(max_tokens=4), use_tqdm=False)
            for streams in streams_list:
                totals = llm.llm_engine.spec_decode_totals
                if totals is not None:
                    totals.reset()
                row = {"method": method, "workload": workload, "streams": streams,
                       **drive(llm, workloads[workload], params, streams)}
                if totals is not None:
                    row["acceptance_rate"] = round(totals.acceptance_rate, 4)
                    row["mean_acceptance_length"] = round(totals.mean_acceptance_length, 3)
                    row["acceptance_per_position"] = [round(p, 4) for p in totals.per_position_acceptance]
                print(json.dumps(row), flush=True)
                results.append(row)
        del llm
    baseline = {(r["workload"], r["streams"]): r["median_tpot_ms"] for r in results if r["method"] == "none"}
    for r in results:
        base = baseline.get((r["workload"], r["streams"]))
        if base:
            r["tpot_vs_none"] = round(r["median_tpot_ms"] / base, 3)
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "args": vars(args),
        "results": results,
    }
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
