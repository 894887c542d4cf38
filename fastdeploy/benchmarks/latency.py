"""``fastdeploy bench latency``: time one batch's generation end to end (vLLM's ``vllm bench latency``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

import numpy as np

from fastdeploy.engine.arg_utils import EngineArgs

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's latency flags plus every engine flag."""
    parser.add_argument("--input-len", type=int, default=32, help="Prompt tokens per request.")
    parser.add_argument("--output-len", type=int, default=128, help="Generated tokens per request.")
    parser.add_argument("--batch-size", type=int, default=8, help="Requests in the batch.")
    parser.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="Untimed iterations first.")
    parser.add_argument("--num-iters", type=int, default=30, help="Timed iterations.")
    parser.add_argument("--output-json", type=str, default=None, help="Save the latencies as JSON here.")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="Skip detokenization (its cost is then not in the latency).")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bars.")
    EngineArgs.add_cli_args(parser)


def make_llm(args: argparse.Namespace) -> Any:
    """The offline engine from the engine flags."""
    from fastdeploy import LLM

    engine_args = EngineArgs.from_cli_args(args)
    return LLM(**dataclasses.asdict(engine_args))


def latency_result(latencies: list[float]) -> dict[str, Any]:
    """vLLM's latency JSON: ``avg_latency``, ``latencies`` and ``percentiles`` (seconds)."""
    arr = np.asarray(latencies, dtype=np.float64)
    return {"avg_latency": float(np.mean(arr)), "latencies": arr.tolist(),
            "percentiles": {str(p): float(np.percentile(arr, p)) for p in LATENCY_PERCENTILES}}


def main(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    from fastdeploy import SamplingParams

    llm = make_llm(args)
    sampling_params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                                     max_tokens=args.output_len, detokenize=not args.disable_detokenize)
    # Random token ids: the latency does not depend on what the prompt says, only on its length.
    rng = np.random.default_rng(getattr(args, "seed", 0) or 0)
    prompts = [{"prompt_token_ids": ids} for ids in rng.integers(100, 10000, size=(args.batch_size,
                                                                                  args.input_len)).tolist()]
    print(sampling_params)

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, sampling_params=sampling_params, use_tqdm=False)
        return time.perf_counter() - start

    print("Warming up...")
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations", disable=args.disable_tqdm):
        run_once()
    latencies = [run_once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations",
                                         disable=args.disable_tqdm)]
    result = latency_result(latencies)
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value} seconds")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=4)
    return result
