"""Model steps with the weights and KV cache in 2 MB huge pages against 4 KB pages (FD_CPU_HUGE_PAGES=1 / 0).

Huge pages are a property of a process's memory, so the two settings cannot take turns in one
process as benchmark_kernels' configurations do: each round starts one child process per setting
(the order alternating round by round, so drift on a shared machine hits both alike) and each child
loads the model, then times a 256-token prefill, decode steps of one sequence and of 16 sequences
over ``--context`` tokens each. Medians per child, then medians over the rounds; ms.

    python benchmarks/benchmark_huge_pages.py --configs gguf hf-bf16 \\
        --output benchmarks/results/huge_pages_spr_2026-12-06.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from benchmark_kernels import CONFIGS, Setup, _base_config
from interleaved import write_result

SETTINGS = {"4k": "0", "huge": "1"}


def child(config: str, context: int, steps: int) -> dict:
    """One process's figures for ``config`` under the FD_CPU_HUGE_PAGES it was started with."""
    start = time.perf_counter()
    setup = Setup(config, *CONFIGS[_base_config(config)])
    load_s = time.perf_counter() - start
    prefill = statistics.median(setup.prefill(256) for _ in range(3))
    out = {"load_s": round(load_s, 2), "prefill_256_ms": round(prefill, 2)}
    for batch in (1, 16):
        setup.prefill(context, batch, context + steps + 8)
        setup.decode()
        out[f"decode_b{batch}_ms"] = round(statistics.median(setup.decode() for _ in range(steps)), 2)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    return out


def run_child(config: str, setting: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "FD_CPU_HUGE_PAGES": SETTINGS[setting], "OMP_NUM_THREADS": str(args.threads),
           "FD_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, __file__, "--child", config, "--context", str(args.context), "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{config} ({setting}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["gguf"], choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--context", type=int, default=330)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.context, args.steps)))
        return

    result: dict = {"threads": args.threads, "context": args.context, "rounds": args.rounds, "configs": {}}
    for config in args.configs:
        runs: dict[str, list[dict]] = {setting: [] for setting in SETTINGS}
        for r in range(args.rounds):
            for setting in (list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]):
                runs[setting].append(run_child(config, setting, args))
                print(config, setting, runs[setting][-1], flush=True)
        medians = {setting: {key: statistics.median(run[key] for run in rs) for key in rs[0]}
                   for setting, rs in runs.items()}
        ratios = {key: round(medians["huge"][key] / medians["4k"][key], 3)
                  for key in medians["huge"] if key.endswith("_ms")}
        result["configs"][config] = {"median": medians, "huge_over_4k": ratios, "runs": runs}
        print(config, "huge / 4k:", ratios, flush=True)
    write_result(args.output, result)


if __name__ == "__main__":
    main()
