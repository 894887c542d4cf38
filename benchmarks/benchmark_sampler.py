"""Cost of one sampling step, and the runner's per-step host time, for the code on PYTHONPATH.

A sampling step is what the runner pays per step around the model: building the
SamplingMetadata from the persistent batch, the sampler call, and recording the
sampled tokens. It is timed at batch 1, 16, 64 and 256 (vocab 49152) with no
option set (SamplingParams() defaults: temperature 1.0, plain random sampling)
with every option on (temperature 0.8, top-k 50, top-p 0.9, min-p 0.05,
repetition / presence / frequency penalties, a 20-token logit_bias), and with
top-p 0.95 alone over flat logits (most of the vocabulary kept), each request
having a 256-token prompt and 64 earlier outputs.

The runner's host time is ``ModelRunner.execute_model`` at batch 16 decode
minus the model forward and ``compute_logits`` (a stand-in model returns
precomputed tensors, and the time inside it is subtracted).

Run it once per implementation and the JSON gathers both:

    OMP_NUM_THREADS=1 PYTHONPATH=/work/base taskset -c 1 python benchmarks/benchmark_sampler.py --label before
    OMP_NUM_THREADS=1 PYTHONPATH=. taskset -c 1 python benchmarks/benchmark_sampler.py --label after

``--samplers numpy csrc`` times each of the sampler's paths (numpy, or the full-vocabulary passes in
csrc/cpu/sampling.cc) in the same process, as ``LABEL/numpy`` and ``LABEL/csrc``; without it the
runner keeps the platform's choice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import paddle

from fastdeploy.engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from fastdeploy.entrypoints.cli.collect_env import cpu_features, cpuinfo
from fastdeploy.model_executor.layers.sampler import Sampler
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.worker.model_runner import ModelRunner

VOCAB = 49152
PROMPT_LEN = 256
PAST_OUTPUTS = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
HIDDEN = 64


OPTIONS = ("none", "all", "top_p")


def options(name: str, rng: np.random.Generator) -> SamplingParams:
    """``none``: the defaults; ``all``: every sampling option on; ``top_p``: top-p 0.95 alone."""
    if name == "none":
        return SamplingParams(max_tokens=MAX_MODEL_LEN)
    if name == "top_p":
        return SamplingParams(top_p=0.95, max_tokens=MAX_MODEL_LEN)
    bias = {int(t): float(b) for t, b in zip(rng.choice(VOCAB, 20, replace=False), rng.uniform(-5, 5, 20), strict=True)}
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=0.5, logit_bias=bias, max_tokens=MAX_MODEL_LEN)


class StandInModel:
    """Returns precomputed hidden states and logits, and counts the time spent in it."""

    def __init__(self, logits: np.ndarray) -> None:
        self.hidden = paddle.zeros([len(logits), HIDDEN])
        self.logits = paddle.to_tensor(logits)
        self.seconds = 0.0

    def __call__(self, input_ids, positions, kv_caches, meta):  # noqa: ANN001 - the model's signature
        t0 = time.perf_counter()
        out = self.hidden[: input_ids.shape[0]]
        self.seconds += time.perf_counter() - t0
        return out

    def compute_logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        t0 = time.perf_counter()
        out = self.logits[: hidden.shape[0]]
        self.seconds += time.perf_counter() - t0
        return out


def make_runner(batch: int, opt: str, rng: np.random.Generator, logits: np.ndarray, sampler: str | None
                ) -> tuple[ModelRunner, list[str]]:
    """A runner whose batch holds ``batch`` requests that have each just finished a prefill; ``sampler``
    ("numpy" / "csrc") replaces the platform's sampler path."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB, seed=0),
        cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
        scheduler_config=SimpleNamespace(max_num_seqs=max(batch, 16)),
        speculative_config=None,
    )
    runner = ModelRunner(config)
    runner.model = StandInModel(logits)
    if sampler is not None:
        runner.sampler = Sampler(kernels=sampler == "csrc")
    blocks = MAX_MODEL_LEN // BLOCK_SIZE
    new = []
    for i in range(batch):
        tokens = rng.integers(0, VOCAB, PROMPT_LEN + PAST_OUTPUTS).tolist()
        new.append(NewRequestData(f"r{i}", tokens, PROMPT_LEN, options(opt, rng), list(range(i * blocks, (i + 1) * blocks)),
                                  len(tokens) - 1, eos_token_id=0))
    req_ids = [r.req_id for r in new]
    runner.execute_model(SchedulerOutput(new, [], dict.fromkeys(req_ids, 1), batch))
    return runner, req_ids


def sampling_step(runner: ModelRunner, req_ids: list[str], rows: np.ndarray, logits: np.ndarray) -> None:
    """What execute_model does from the logits on, for either implementation."""
    batch = runner.input_batch
    if hasattr(batch, "make_sampling_metadata"):
        md = batch.make_sampling_metadata(rows)
        batch.append_sampled(rows, runner.sampler(logits, md, inplace=True).sampled_token_ids)
        return
    # The implementation before the vectorized sampler: metadata rebuilt per request, tokens recorded per request.
    md = runner._sampling_metadata(req_ids, rows)
    sampled = runner.sampler(logits, md).sampled_token_ids
    pos = batch.num_tokens[rows]
    batch.token_ids[rows, pos] = sampled
    batch.num_tokens[rows] = pos + 1
    for req_id, tok in zip(req_ids, sampled.tolist(), strict=True):
        runner.requests[req_id].output_token_ids.append(tok)


def time_sampling(batch: int, opt: str, iters: int, sampler: str | None) -> tuple[float, float]:
    """Median and minimum milliseconds of one sampling step (the minimum is the least disturbed by other load)."""
    rng = np.random.default_rng(0)
    # Peaked like a language model's logits (the top 1024 tokens hold most of the mass); for top_p,
    # flat like a high-entropy position (they hold ~15%: top-p 0.95 keeps most of the vocabulary).
    logits = (rng.standard_normal((batch, VOCAB)) * (1 if opt == "top_p" else 4)).astype(np.float32)
    runner, req_ids = make_runner(batch, opt, rng, logits, sampler)
    rows = np.array([runner.input_batch.req_id_to_index[r] for r in req_ids])
    times = []
    for _ in range(iters):
        step_logits = logits.copy()  # a fresh array per step, as compute_logits().numpy() gives
        t0 = time.perf_counter()
        sampling_step(runner, req_ids, rows, step_logits)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def time_runner(batch: int, opt: str, steps: int, sampler: str | None) -> tuple[float, float]:
    """Median and minimum host milliseconds of execute_model at ``batch`` decode, model forward and compute_logits excluded."""
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((batch, VOCAB)) * 4).astype(np.float32)
    runner, req_ids = make_runner(batch, opt, rng, logits, sampler)
    model = runner.model
    computed = {r: PROMPT_LEN + PAST_OUTPUTS for r in req_ids}
    times = []
    for _ in range(steps):
        cached = [CachedRequestData(r, [], computed[r]) for r in req_ids]
        so = SchedulerOutput([], cached, dict.fromkeys(req_ids, 1), batch)
        model.seconds = 0.0
        t0 = time.perf_counter()
        runner.execute_model(so)
        times.append(time.perf_counter() - t0 - model.seconds)
        for r in req_ids:
            computed[r] += 1
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="name of this implementation in the JSON, e.g. before / after")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--runner-steps", type=int, default=100)
    parser.add_argument("--samplers", nargs="+", choices=["numpy", "csrc"],
                        help="time each of these sampler paths (default: the platform's)")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "sampler.json")
    args = parser.parse_args()
    data = json.loads(args.output.read_text()) if args.output.exists() else {}
    for sampler in args.samplers or [None]:
        label = args.label if sampler is None else f"{args.label}/{sampler}"
        data.setdefault("results", {})[label] = result = measure(args, sampler)
        print(json.dumps({label: result}, indent=2))
    data.update({
        "what": "one sampling step (metadata from the persistent batch + sampler + recording tokens), "
                f"vocab {VOCAB}, median and minimum ms over the iterations; runner host time = execute_model "
                "minus model forward/compute_logits. The machine's 2 cores are shared with other jobs: medians "
                "move by up to 2x between runs, the minima much less.",
        "cpu": f"{cpuinfo('model name') or 'unknown'} ({cpu_features()})",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "command": "OMP_NUM_THREADS=1 PYTHONPATH=<impl> taskset -c 1 python benchmarks/benchmark_sampler.py --label <label>"
                   " [--samplers numpy csrc]",
    })
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(data, indent=2) + "\n")


def measure(args: argparse.Namespace, sampler: str | None) -> dict:
    """The step and runner figures of one sampler path."""
    step = {opt: {str(b): time_sampling(b, opt, args.iters if b > 1 else 10 * args.iters, sampler)
                  for b in args.batch_sizes} for opt in OPTIONS}
    runner = {opt: time_runner(16, opt, args.runner_steps, sampler) for opt in ("none", "all")}
    return {
        "sampling_step_ms": {opt: {b: round(t[0], 3) for b, t in v.items()} for opt, v in step.items()},
        "sampling_step_min_ms": {opt: {b: round(t[1], 3) for b, t in v.items()} for opt, v in step.items()},
        "all_over_none_min": {b: round(step["all"][b][1] / step["none"][b][1], 2) for b in step["all"]},
        "top_p_over_none_min": {b: round(step["top_p"][b][1] / step["none"][b][1], 2) for b in step["top_p"]},
        "runner_host_ms_batch16_decode": {opt: round(t[0], 3) for opt, t in runner.items()},
        "runner_host_min_ms_batch16_decode": {opt: round(t[1], 3) for opt, t in runner.items()},
    }


if __name__ == "__main__":
    main()
