"""``fastdeploy bench serve``: online serving benchmark against a running OpenAI-compatible server.

The flags, the printed "Serving Benchmark Result" table and the saved JSON keys
are those of ``vllm bench serve``, so the two tools' results sit side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from fastdeploy import envs
from fastdeploy.benchmarks.datasets import SampleRequest, add_dataset_parser, get_samples
from fastdeploy.benchmarks.endpoint_request_func import (
    AIOHTTP_TIMEOUT_S,
    ASYNC_REQUEST_FUNCS,
    DEFAULT_ENDPOINTS,
    RequestFuncInput,
    RequestFuncOutput,
)

# The metrics with percentiles: name in the JSON keys -> (label in the table, section header).
METRIC_LABELS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl"
# Per-request lists kept in the JSON only with --save-detailed (as vLLM).
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors")


@dataclass
class BenchmarkMetrics:
    """Aggregates of one run; the ``*_ms`` dicts map ``mean``/``median``/``std``/``pNN`` to milliseconds."""

    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats_ms: dict[str, dict[str, float]] = field(default_factory=dict)


def percentile_word(p: float) -> str:
    """``99`` -> "99", ``99.9`` -> "99.9" (the key and label style of vLLM)."""
    return str(int(p)) if int(p) == p else str(p)


def summarize_ms(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    """Mean, median, std and percentiles in ms; an empty list gives zeros (as vLLM's ``x or 0``)."""
    arr = np.asarray(values_s or [0.0], dtype=np.float64) * 1000
    stats = {"mean": float(np.mean(arr)), "median": float(np.median(arr)), "std": float(np.std(arr))}
    for p in percentiles:
        stats[f"p{percentile_word(p)}"] = float(np.percentile(arr, p))
    return stats


def peak_rates(outputs: list[RequestFuncOutput], bench_start: float) -> tuple[float, int]:
    """Peak output tokens per one-second bucket and peak concurrent requests (vLLM's "Peak" lines).

    A token's time is the request's start plus its TTFT plus the ITL gaps so far; a
    request is in flight from its start to its end.
    """
    token_buckets: dict[int, int] = {}
    spans = []
    for out in outputs:
        if not out.success:
            continue
        t = out.start_time + out.ttft
        times = [t]
        for gap in out.itl:
            t += gap
            times.append(t)
        for token_time in times:
            bucket = int(token_time - bench_start)
            token_buckets[bucket] = token_buckets.get(bucket, 0) + 1
        spans.append((out.start_time - bench_start, out.start_time + out.latency - bench_start))
    # Concurrency changes only at request starts, so its maximum is attained at one of them.
    max_concurrent = max((sum(1 for s, e in spans if s <= start <= e) for start, _ in spans), default=0)
    return float(max(token_buckets.values(), default=0)), max_concurrent


def calculate_metrics(input_requests: list[SampleRequest], outputs: list[RequestFuncOutput], dur_s: float,
                      tokenizer: Any, selected_percentile_metrics: list[str], selected_percentiles: list[float],
                      bench_start: float | None = None) -> tuple[BenchmarkMetrics, list[int]]:
    """vLLM's definitions: TPOT = (latency - TTFT) / (output tokens - 1), over requests with > 1 token;
    ITL = every gap between consecutive streamed chunks; E2EL = request latency."""
    actual_output_lens: list[int] = []
    total_input = completed = 0
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    for request, out in zip(input_requests, outputs, strict=True):
        if not out.success:
            actual_output_lens.append(0)
            continue
        output_len = out.output_tokens
        if not output_len:
            # A server that reports no usage: count the generated text's tokens instead.
            output_len = len(tokenizer.encode(out.generated_text, add_special_tokens=False))
        actual_output_lens.append(output_len)
        total_input += request.prompt_len
        if output_len > 1:
            tpots.append((out.latency - out.ttft) / (output_len - 1))
        itls += out.itl
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        completed += 1
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    total_output = sum(actual_output_lens)
    max_tokens_per_s, max_concurrent = peak_rates(outputs, bench_start if bench_start is not None else min(
        (o.start_time for o in outputs), default=0.0))
    metrics = BenchmarkMetrics(
        completed=completed,
        failed=len(outputs) - completed,
        total_input=total_input,
        total_output=total_output,
        request_throughput=completed / dur_s,
        output_throughput=total_output / dur_s,
        total_token_throughput=(total_input + total_output) / dur_s,
        max_output_tokens_per_s=max_tokens_per_s,
        max_concurrent_requests=max_concurrent,
        stats_ms={m: summarize_ms(values[m], selected_percentiles) for m in selected_percentile_metrics},
    )
    return metrics, actual_output_lens


async def get_request(input_requests: list[SampleRequest], request_rate: float, burstiness: float = 1.0,
                      seed: int = 0) -> AsyncIterator[SampleRequest]:
    """Yield requests at ``request_rate`` per second with gamma-distributed gaps (Poisson at burstiness 1).

    Smaller burstiness gives burstier arrivals at the same mean rate; ``inf`` sends all at once.
    """
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}.")
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness) if request_rate != float("inf") else 0.0
    for request in input_requests:
        yield request
        if request_rate == float("inf"):
            continue
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


def print_results(metrics: BenchmarkMetrics, benchmark_duration: float, max_concurrency: int | None,
                  request_rate: float, selected_percentile_metrics: list[str],
                  selected_percentiles: list[float]) -> None:
    """The "Serving Benchmark Result" table, line for line as vLLM prints it."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", metrics.completed))
    if metrics.failed:
        print("{:<40} {:<10}".format("Failed requests:", metrics.failed))
    if max_concurrency is not None:
        print("{:<40} {:<10}".format("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        print("{:<40} {:<10.2f}".format("Request rate configured (RPS):", request_rate))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", benchmark_duration))
    print("{:<40} {:<10}".format("Total input tokens:", metrics.total_input))
    print("{:<40} {:<10}".format("Total generated tokens:", metrics.total_output))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", metrics.request_throughput))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", metrics.output_throughput))
    print("{:<40} {:<10.2f}".format("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s))
    print("{:<40} {:<10.2f}".format("Peak concurrent requests:", metrics.max_concurrent_requests))
    print("{:<40} {:<10.2f}".format("Total Token throughput (tok/s):", metrics.total_token_throughput))
    for metric in selected_percentile_metrics:
        label, header = METRIC_LABELS[metric]
        stats = metrics.stats_ms[metric]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {label} (ms):", stats["mean"]))
        print("{:<40} {:<10.2f}".format(f"Median {label} (ms):", stats["median"]))
        for p in selected_percentiles:
            word = percentile_word(p)
            print("{:<40} {:<10.2f}".format(f"P{word} {label} (ms):", stats[f"p{word}"]))
    print("=" * 50)


def metrics_to_result(metrics: BenchmarkMetrics, duration: float, outputs: list[RequestFuncOutput],
                      input_requests: list[SampleRequest], actual_output_lens: list[int]) -> dict[str, Any]:
    """The result dict with vLLM's JSON keys (``mean_ttft_ms``, ``p99_itl_ms``, ``output_throughput``...)."""
    result: dict[str, Any] = {
        "duration": duration,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [r.prompt_len for r in input_requests],
        "output_lens": actual_output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for metric, stats in metrics.stats_ms.items():
        for stat, value in stats.items():
            result[f"{stat}_{metric}_ms"] = value
    return result


async def benchmark(*, backend: str, api_url: str, model_id: str, model_name: str | None, tokenizer: Any,
                    input_requests: list[SampleRequest], request_rate: float, burstiness: float,
                    disable_tqdm: bool, ignore_eos: bool, selected_percentile_metrics: list[str],
                    selected_percentiles: list[float], max_concurrency: int | None, seed: int = 0,
                    api_key: str | None = None, extra_body: dict[str, Any] | None = None,
                    skip_test_prompt: bool = False) -> dict[str, Any]:
    """Send every request (rate- and concurrency-limited), print the table, return vLLM's result dict."""
    import aiohttp
    from tqdm.asyncio import tqdm

    request_func = ASYNC_REQUEST_FUNCS[backend]

    def make_input(request: SampleRequest) -> RequestFuncInput:
        return RequestFuncInput(prompt=request.prompt, api_url=api_url, prompt_len=request.prompt_len,
                                output_len=request.expected_output_len, model=model_id, model_name=model_name,
                                ignore_eos=ignore_eos, extra_body=extra_body, api_key=api_key)

    # Enough connections for the concurrency; no keep-alive limit surprises mid-run.
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, force_close=False)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=AIOHTTP_TIMEOUT_S), connector=connector, trust_env=True) as session:
        if not skip_test_prompt:
            # One request first, as vLLM: a wrong URL or model fails here with the server's message.
            print("Starting initial single prompt test run...")
            test = await request_func(make_input(input_requests[0]), session, None)
            if not test.success:
                raise ValueError(f"Initial test run failed - Please make sure benchmark arguments are correctly "
                                 f"specified. Error: {test.error}")
            print("Initial test run completed. Starting main benchmark run...")
        distribution = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
        print(f"Traffic request rate: {request_rate}")
        print(f"Burstiness factor: {burstiness} ({distribution})")
        print(f"Maximum request concurrency: {max_concurrency}")
        pbar = None if disable_tqdm else tqdm(total=len(input_requests))
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(request: SampleRequest) -> RequestFuncOutput:
            if semaphore is None:
                return await request_func(make_input(request), session, pbar)
            async with semaphore:
                return await request_func(make_input(request), session, pbar)

        bench_start = time.perf_counter()
        tasks = []
        async for request in get_request(input_requests, request_rate, burstiness, seed):
            tasks.append(asyncio.create_task(limited(request)))
        outputs: list[RequestFuncOutput] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - bench_start
        if pbar is not None:
            pbar.close()
    metrics, actual_output_lens = calculate_metrics(input_requests, outputs, duration, tokenizer,
                                                    selected_percentile_metrics, selected_percentiles,
                                                    bench_start=bench_start)
    print_results(metrics, duration, max_concurrency, request_rate, selected_percentile_metrics,
                  selected_percentiles)
    return metrics_to_result(metrics, duration, outputs, input_requests, actual_output_lens)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``vllm bench serve``'s flags."""
    add_dataset_parser(parser)
    parser.add_argument("--label", type=str, default=None,
                        help="Label (prefix) of the result file name; default: the backend.")
    parser.add_argument("--backend", type=str, default="openai", choices=sorted(ASYNC_REQUEST_FUNCS),
                        help="Client: openai (/v1/completions; 'vllm' is an alias) or openai-chat.")
    parser.add_argument("--base-url", type=str, default=None, help="Server URL if not --host/--port.")
    parser.add_argument("--host", type=str, default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", type=str, default=None,
                        help="API path (default: /v1/completions, or /v1/chat/completions for openai-chat).")
    parser.add_argument("--model", type=str, default=None,
                        help="Model name (default: the first model the server lists at /v1/models).")
    parser.add_argument("--served-model-name", type=str, default=None,
                        help="Name sent in requests if not --model (--model still picks the tokenizer).")
    parser.add_argument("--tokenizer", type=str, default=None, help="Tokenizer for counting (default: --model).")
    parser.add_argument("--tokenizer-mode", type=str, default="auto", choices=["auto", "slow"])
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="Most requests in flight at once (default: unlimited).")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second (Poisson arrivals); inf sends them all at time 0.")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier, > 1 more uniform.")
    parser.add_argument("--ignore-eos", action="store_true", help="Generate exactly the requested output length.")
    parser.add_argument("--disable-tqdm", action="store_true", help="No progress bar.")
    parser.add_argument("--save-result", action="store_true", help="Save the result JSON.")
    parser.add_argument("--save-detailed", action="store_true",
                        help="Keep per-request lists (ttfts, itls, generated_texts...) in the JSON.")
    parser.add_argument("--append-result", action="store_true", help="Append to the result file as a JSON line.")
    parser.add_argument("--result-dir", type=str, default=None, help="Folder of the result JSON (default: .).")
    parser.add_argument("--result-filename", type=str, default=None,
                        help="Result file name (default: {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json).")
    parser.add_argument("--metadata", metavar="KEY=VALUE", nargs="*",
                        help="KEY=VALUE pairs saved in the result JSON (e.g. the server's version).")
    parser.add_argument("--percentile-metrics", type=str, default=DEFAULT_PERCENTILE_METRICS,
                        help="Comma-separated metrics with percentiles: ttft, tpot, itl, e2el.")
    parser.add_argument("--metric-percentiles", type=str, default="99",
                        help="Comma-separated percentiles to report, e.g. 25,50,99.")
    parser.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body.")
    parser.add_argument("--skip-test-prompt", action="store_true", help="Do not send the initial test request.")


def _parse_metadata(items: list[str] | None) -> dict[str, str]:
    metadata = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"Invalid --metadata {item!r}: use KEY=VALUE.")
        key, value = item.split("=", 1)
        metadata[key.strip()] = value.strip()
    return metadata


def _api_urls(args: argparse.Namespace) -> tuple[str, str]:
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[args.backend]
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return f"{base_url}{endpoint}", base_url


def _served_models(base_url: str, api_key: str | None) -> list[str]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return [m["id"] for m in response.json()["data"]]


def result_filename(args: argparse.Namespace, model_id: str, when: datetime) -> str:
    """vLLM's default name: ``{label}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json``."""
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    label = args.label or args.backend
    return f"{label}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{when.strftime('%Y%m%d-%H%M%S')}.json"


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``bench serve`` with parsed flags; returns the result dict (also saved with --save-result)."""
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    np.random.seed(args.seed)
    api_url, base_url = _api_urls(args)
    api_key = envs.openai_api_key()
    model_id = args.model
    if model_id is None:
        models = _served_models(base_url, api_key)
        if not models:
            raise ValueError(f"The server at {base_url} lists no model; pass --model.")
        model_id = models[0]
    selected_percentile_metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in selected_percentile_metrics if m not in METRIC_LABELS]
    if unknown:
        raise ValueError(f"Unknown --percentile-metrics {unknown}; choose from {', '.join(METRIC_LABELS)}.")
    selected_percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    metadata = _parse_metadata(args.metadata)
    # The served model's own tokenizer counts tokens; the default model's name resolves offline.
    tokenizer_id = args.tokenizer or model_id
    tokenizer = get_tokenizer(tokenizer_id, tokenizer_mode=args.tokenizer_mode,
                              trust_remote_code=args.trust_remote_code)
    input_requests = get_samples(args, tokenizer)
    result = asyncio.run(benchmark(
        backend=args.backend, api_url=api_url, model_id=model_id, model_name=args.served_model_name,
        tokenizer=tokenizer, input_requests=input_requests, request_rate=args.request_rate,
        burstiness=args.burstiness, disable_tqdm=args.disable_tqdm, ignore_eos=args.ignore_eos,
        selected_percentile_metrics=selected_percentile_metrics, selected_percentiles=selected_percentiles,
        max_concurrency=args.max_concurrency, seed=args.seed, api_key=api_key, extra_body=args.extra_body,
        skip_test_prompt=args.skip_test_prompt))
    if args.save_result or args.append_result:
        when = datetime.now()
        result_json: dict[str, Any] = {
            "date": when.strftime("%Y%m%d-%H%M%S"),
            "endpoint_type": args.backend,
            "label": args.label,
            "model_id": model_id,
            "tokenizer_id": tokenizer_id,
            "num_prompts": args.num_prompts,
            **metadata,
            # JSON has no infinity: vLLM writes the string "inf".
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            **result,
        }
        if not args.save_detailed:
            for key in DETAILED_FIELDS:
                result_json.pop(key, None)
        filename = args.result_filename or result_filename(args, model_id, when)
        if args.result_dir:
            os.makedirs(args.result_dir, exist_ok=True)
            filename = os.path.join(args.result_dir, filename)
        with open(filename, "a" if args.append_result else "w", encoding="utf-8") as f:
            if args.append_result and f.tell() > 0:
                f.write("\n")
            json.dump(result_json, f)
    return result
