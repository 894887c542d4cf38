"""Offline throughput of the PaddleFormers backend relative to the native model, same run.

Both engines serve the embedded SmolLM2-135M-Instruct (GGUF, dequantized):
``LLM(model_impl="fastdeploy")`` and ``LLM(model_impl="paddleformers")``, same random
prompts, greedy with ``ignore_eos``, for each ``--dtypes`` entry ("auto" is bf16 where
the CPU and the C++ kernels allow it). Both are built and warmed up first, then measured
in alternation (``--repeats`` rounds) so that drift of the shared machine hits both
alike. Throughput is reported per wall-clock second (each backend's fastest run) and per
CPU second of this process (``time.process_time``, summed over threads): on a shared
machine other work inflates wall time run to run, while CPU time stays close to the work
done, so the CPU-time ratio is the steadier comparison (run with ``OMP_NUM_THREADS=1``
so that OpenMP spin-waiting does not count as work). Also records whether both produced
the same tokens (in bf16 they may part: the backend keeps an fp32 KV cache).

    OMP_NUM_THREADS=1 python benchmarks/benchmark_paddleformers.py --num-prompts 16 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from benchmark_offline_throughput import random_prompts, summarize

IMPLS = ("fastdeploy", "paddleformers")


def build(impl: str, dtype: str, num_prompts: int):
    """An LLM on the default model with ``model_impl=impl``, and its load time."""
    from fastdeploy import LLM

    t0 = time.perf_counter()
    # The native model on the same dequantized weights as PaddleFormers (a GGUF's default would keep its blocks).
    quantization = "none" if impl == "fastdeploy" else None
    llm = LLM(model_impl=impl, dtype=dtype, quantization=quantization, max_model_len=2048, max_num_seqs=num_prompts,
              kv_cache_memory_bytes=1 << 30)
    return llm, time.perf_counter() - t0


def measure(llm, prompts, output_len: int) -> tuple[float, float, list[list[int]]]:
    """Wall and CPU seconds of one ``generate`` over all prompts, and the generated token ids."""
    from fastdeploy import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t0, time.process_time() - c0, [list(o.outputs[0].token_ids) for o in outs]


def compare(dtype: str, prompts: list[list[int]], output_len: int, repeats: int) -> dict:
    """Both backends in ``dtype``, measured alternately; the summary rows and their ratio."""
    engines = {}
    for impl in IMPLS:
        llm, load_s = build(impl, dtype, len(prompts))
        measure(llm, prompts[:2], 4)  # warm-up
        engines[impl] = (llm, load_s)
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    cpu_times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for impl in IMPLS:
            elapsed, cpu, tokens[impl] = measure(engines[impl][0], prompts, output_len)
            times[impl].append(elapsed)
            cpu_times[impl].append(cpu)
    results = []
    for impl in IMPLS:
        llm, load_s = engines[impl]
        out_tokens = sum(len(t) for t in tokens[impl])
        row = summarize(impl, prompts, out_tokens, min(times[impl]), load_s)
        row["runs_s"] = [round(t, 2) for t in times[impl]]
        row["mean_output_tokens_per_s"] = round(out_tokens / statistics.mean(times[impl]), 2)
        row["cpu_runs_s"] = [round(t, 2) for t in cpu_times[impl]]
        row["output_tokens_per_cpu_s"] = round(out_tokens / min(cpu_times[impl]), 2)
        row["compute_dtype"] = getattr(llm.llm_engine.engine_core.worker.model_runner.model, "compute_dtype", None)
        results.append(row)
    native, backend = results
    return {
        "dtype": dtype,
        "results": results,
        "paddleformers_vs_native_output_throughput": round(
            backend["output_tokens_per_s"] / native["output_tokens_per_s"], 3
        ),
        "paddleformers_vs_native_mean_output_throughput": round(
            backend["mean_output_tokens_per_s"] / native["mean_output_tokens_per_s"], 3
        ),
        "paddleformers_vs_native_output_per_cpu_s": round(
            backend["output_tokens_per_cpu_s"] / native["output_tokens_per_cpu_s"], 3
        ),
        "same_tokens": tokens["fastdeploy"] == tokens["paddleformers"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per backend, alternating")
    parser.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output-json", default=os.path.join(os.path.dirname(__file__), "results", "paddleformers.json")
    )
    args = parser.parse_args()

    prompts = random_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    report = {
        "benchmark": "paddleformers_backend_vs_native",
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": [compare(dtype, prompts, args.output_len, args.repeats) for dtype in args.dtypes],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
