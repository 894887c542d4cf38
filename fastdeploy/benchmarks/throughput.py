"""``fastdeploy bench throughput``: offline throughput of a dataset through ``LLM.generate``
(vLLM's ``vllm bench throughput``)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from fastdeploy.benchmarks.datasets import DATASET_NAMES, SampleRequest, get_samples
from fastdeploy.benchmarks.latency import make_llm
from fastdeploy.engine.arg_utils import EngineArgs


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's throughput flags plus every engine flag."""
    parser.add_argument("--backend", type=str, choices=["vllm", "fastdeploy"], default="vllm",
                        help="Offline engine ('vllm' for vLLM compatibility: FastDeploy's LLM either way).")
    parser.add_argument("--dataset-name", choices=DATASET_NAMES, default="random", help="Dataset to benchmark on.")
    parser.add_argument("--dataset-path", type=str, default=None, help="Dataset file (sharegpt, custom).")
    parser.add_argument("--input-len", type=int, default=None, help="Prompt tokens per request (random).")
    parser.add_argument("--output-len", type=int, default=None,
                        help="Generated tokens per request (default: random 128, the dataset's for sharegpt).")
    parser.add_argument("--n", type=int, default=1, help="Sequences generated per prompt.")
    parser.add_argument("--num-prompts", type=int, default=1000, help="Number of prompts to process.")
    parser.add_argument("--prefix-len", type=int, default=0, help="Shared random prefix tokens (random).")
    parser.add_argument("--random-range-ratio", type=float, default=0.0, help="Length range ratio (random).")
    parser.add_argument("--output-json", type=str, default=None, help="Save the throughput results as JSON here.")
    parser.add_argument("--disable-detokenize", action="store_true", help="Skip detokenization.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    EngineArgs.add_cli_args(parser)


def _dataset_args(args: argparse.Namespace) -> argparse.Namespace:
    """Map the throughput flags onto the dataset flags ``get_samples`` reads (as vLLM does)."""
    output_len = args.output_len
    return argparse.Namespace(
        dataset_name=args.dataset_name, dataset_path=args.dataset_path, num_prompts=args.num_prompts,
        seed=args.seed if args.seed is not None else 0,
        random_input_len=args.input_len or 1024, random_output_len=output_len or 128,
        random_range_ratio=args.random_range_ratio, random_prefix_len=args.prefix_len,
        sharegpt_output_len=output_len, custom_output_len=output_len or 256, skip_chat_template=False,
        prefix_repetition_prefix_len=args.prefix_len or 256, prefix_repetition_suffix_len=args.input_len or 256,
        prefix_repetition_num_prefixes=10, prefix_repetition_output_len=output_len or 128)


def throughput_result(requests: list[SampleRequest], elapsed_s: float, total_output_tokens: int) -> dict[str, Any]:
    """vLLM's throughput JSON keys."""
    total_prompt_tokens = sum(r.prompt_len for r in requests)
    total_num_tokens = total_prompt_tokens + total_output_tokens
    return {"elapsed_time": elapsed_s, "num_requests": len(requests), "total_num_tokens": total_num_tokens,
            "total_prompt_tokens": total_prompt_tokens, "total_output_tokens": total_output_tokens,
            "requests_per_second": len(requests) / elapsed_s, "tokens_per_second": total_num_tokens / elapsed_s,
            "output_tokens_per_second": total_output_tokens / elapsed_s}


def main(args: argparse.Namespace) -> dict[str, Any]:
    from fastdeploy import SamplingParams
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(args.tokenizer or args.model, trust_remote_code=args.trust_remote_code)
    requests = get_samples(_dataset_args(args), tokenizer)
    llm = make_llm(args)
    params = [SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len,
                             detokenize=not args.disable_detokenize) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    total_output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = throughput_result(requests, elapsed, total_output_tokens)
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {result['total_prompt_tokens']}")
    print(f"Total num output tokens:  {result['total_output_tokens']}")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=4)
    return result
