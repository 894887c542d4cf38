"""lm-eval loglikelihood through ``fastdeploy serve`` vs ``lm_eval --model hf``: same questions, one run.

The questions are the MMLU exemplars lm-eval ships with its tasks
(``tasks/mmlu/flan_cot_fewshot/_cot_prompts.json``: about five per subject, with their
answers), so nothing is downloaded. Each becomes an MMLU-style zero-shot
multiple-choice document (question, the four options, ``Answer:``; choices
`` A`` .. `` D``), i.e. four ``echo`` + ``logprobs`` + ``max_tokens`` completions that
share their whole context, as lm-eval's ``local-completions`` sends them; five
exemplars drawn from the other questions go before each (lm-eval's seeded sampler,
the same for both backends), as MMLU's 5-shot.

Back to back on this machine (it is shared, so only figures of one run compare):

1. ``fastdeploy serve`` (``--dtype float32``, the default GGUF model) and lm-eval's
   ``local-completions`` against it with ``num_concurrent``;
2. ``lm_eval --model hf`` (fp32, CPU) on the same checkpoint converted to an HF folder
   (benchmarks/compare_vllm.py's converter, cached).

Written to benchmarks/results/lm_eval.json: per backend the lm-eval wall time (the
``lm_eval`` process, model loading included for hf; the server's own start-up
excluded), requests/s over it, accuracy, and the per-question agreement of the
chosen answers between the two.

    python benchmarks/benchmark_lm_eval.py --limit 16                # 16 questions, 5-shot
    python benchmarks/benchmark_lm_eval.py --subjects all --limit 0  # every exemplar (long)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_vllm import (  # noqa: E402
    cpu_description,
    ensure_hf_model,
    fastdeploy_command,
    get_open_port,
    running_server,
    server_environment,
)

from fastdeploy import envs  # noqa: E402
from fastdeploy.transformers_utils.model_resolver import DEFAULT_MODEL_NAME  # noqa: E402
from fastdeploy.transformers_utils.tokenizer import get_tokenizer  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(ROOT, "benchmarks", "results", "lm_eval.json")
DEFAULT_SUBJECTS = "astronomy,college_biology,high_school_geography,marketing,nutrition,sociology"
TASK_NAME = "fd_mmlu_exemplars"
TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
fewshot_split: test
output_type: multiple_choice
doc_to_text: "{{{{question.strip()}}}}\\nA. {{{{choices[0]}}}}\\nB. {{{{choices[1]}}}}\\nC. {{{{choices[2]}}}}\\nD. {{{{choices[3]}}}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
"""
_OPTIONS = re.compile(r"\(A\)(.*?)\(B\)(.*?)\(C\)(.*?)\(D\)(.*)", re.S)
_ANSWER = re.compile(r"answer is \(([ABCD])\)")


def mmlu_exemplars(subjects: list[str] | None) -> list[dict[str, Any]]:
    """Question / four choices / answer index of each parsable exemplar of the chosen subjects."""
    import lm_eval

    path = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "mmlu", "flan_cot_fewshot", "_cot_prompts.json")
    with open(path) as f:
        prompts: dict[str, str] = json.load(f)
    docs = []
    for subject in subjects or sorted(prompts):
        # Each exemplar is "Q: question\n(A) .. (B) .. (C) .. (D) ..\nA: reasoning. The answer is (X)."
        for block in prompts[subject].split("\n\nQ: ")[1:]:
            question_part, _, answer_part = block.partition("\nA: ")
            options, answer = _OPTIONS.search(question_part), _ANSWER.search(answer_part)
            if options is None or answer is None:
                continue  # an exemplar whose options are not on the "(A) .. (D)" pattern
            docs.append({"subject": subject, "question": question_part[: options.start()].strip(),
                         "choices": [c.strip() for c in options.groups()], "answer": "ABCD".index(answer.group(1))})
    return docs


def write_task(docs: list[dict[str, Any]], folder: str) -> None:
    data = os.path.join(folder, f"{TASK_NAME}.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in docs)
    with open(os.path.join(folder, f"{TASK_NAME}.yaml"), "w") as f:
        f.write(TASK_YAML.format(name=TASK_NAME, data=data))


def run_lm_eval(model: str, model_args: str, task_dir: str, out_dir: str, extra: list[str],
                env: dict[str, str], limit: int, num_fewshot: int) -> dict[str, Any]:
    """One ``lm_eval`` process: its wall time, accuracy and per-document chosen answer."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK_NAME,
           "--include_path", task_dir, "--log_samples", "--output_path", out_dir, *extra]
    if limit:
        cmd += ["--limit", str(limit)]
    if num_fewshot:
        cmd += ["--num_fewshot", str(num_fewshot)]
    print(f"[{model}] {' '.join(cmd)}", flush=True)
    t0 = time.monotonic()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if run.returncode != 0:
        raise RuntimeError(f"lm_eval --model {model} failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    samples = []
    for root, _, files in os.walk(out_dir):
        for name in files:
            if name.startswith(f"samples_{TASK_NAME}_") and name.endswith(".jsonl"):
                with open(os.path.join(root, name)) as f:
                    samples += [json.loads(line) for line in f if line.strip()]
    samples.sort(key=lambda s: s["doc_id"])
    # lm-eval's acc picks the choice with the largest loglikelihood.
    chosen = {s["doc_id"]: max(range(len(s["resps"])), key=lambda i: float(s["resps"][i][0][0])) for s in samples}
    num_requests = sum(len(s["resps"]) for s in samples)
    return {"wall_s": round(wall, 1), "num_docs": len(samples), "num_requests": num_requests,
            "requests_per_s": round(num_requests / wall, 3),
            "acc": round(sum(float(s["acc"]) for s in samples) / max(len(samples), 1), 4),
            "chosen": chosen}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--subjects", default=DEFAULT_SUBJECTS, help="Comma-separated MMLU subjects, or 'all'.")
    parser.add_argument("--limit", type=int, default=0, help="lm-eval --limit (0: every exemplar of the subjects).")
    parser.add_argument("--num-fewshot", type=int, default=5,
                        help="Exemplars (of the other questions, lm-eval's seeded sampler) before each question: "
                             "MMLU's usual 5 make prompts of about 1,000 tokens.")
    parser.add_argument("--num-concurrent", type=int, default=4)
    parser.add_argument("--backends", default="fastdeploy,hf", help="Comma-separated subset of fastdeploy, hf.")
    parser.add_argument("--fastdeploy-args", default="", help="Extra flags for `fastdeploy serve`.")
    parser.add_argument("--label", default="", help="Stored with the result (e.g. 'before').")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--before", default=None,
                        help="JSON of an earlier run (e.g. the code before a change) to keep beside this one.")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    subjects = None if args.subjects == "all" else [s.strip() for s in args.subjects.split(",") if s.strip()]
    docs = mmlu_exemplars(subjects)
    work = tempfile.mkdtemp(prefix="fd-lm-eval-")
    write_task(docs, work)
    # Neither backend inherits the OMP_NUM_THREADS that importing fastdeploy set here: the server
    # would take it for the user's choice and run its engine on every core, unpinned, beside the
    # HTTP process (34 s instead of 27 s for --limit 16), not as `fastdeploy serve` runs by default.
    base_env = server_environment()
    env = {**base_env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": os.path.join(work, "hf-cache"), "OPENAI_API_KEY": "EMPTY"}
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    report: dict[str, Any] = {
        "date": datetime.now().isoformat(timespec="seconds"),
        "label": args.label,
        "model": DEFAULT_MODEL_NAME,
        "dtype": "float32",
        "machine": {"cpu_count": os.cpu_count(), "cpu": cpu_description(),
                    "loadavg_start": [round(x, 2) for x in os.getloadavg()],
                    "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        "command": " ".join([os.path.relpath(__file__, ROOT), *(argv if argv is not None else sys.argv[1:])]),
        "subjects": subjects or "all", "limit": args.limit, "num_fewshot": args.num_fewshot, "num_concurrent": args.num_concurrent,
        "num_docs_available": len(docs), "results": {},
    }
    model_dir = ensure_hf_model(envs.cache_root())
    # Both backends tokenize with FastDeploy's GGUF tokenizer, saved as an HF one: the same token
    # ids. (The converted folder holds transformers' GGUF tokenizer, which maps the spaces of this
    # byte-level BPE to token 0: every question would be garbled, for both.)
    tokenizer_dir = os.path.join(work, "tokenizer")
    get_tokenizer(None).save_pretrained(tokenizer_dir)
    for backend in backends:
        out = os.path.join(work, f"out-{backend}")
        if backend == "fastdeploy":
            port = get_open_port()
            cmd = fastdeploy_command(port, ["--dtype", "float32", "--disable-log-requests",
                                            *args.fastdeploy_args.split()])
            with running_server("fastdeploy", cmd, base_env, port, work, args.startup_timeout) as rss:
                model_args = (f"model={DEFAULT_MODEL_NAME},base_url=http://127.0.0.1:{port}/v1/completions,"
                              f"tokenizer={tokenizer_dir},num_concurrent={args.num_concurrent},max_retries=3")
                result = run_lm_eval("local-completions", model_args, work, out, [], env, args.limit, args.num_fewshot)
                result["server_command"] = " ".join(cmd[1:])
                result["server_startup_s"] = round(rss.startup_s, 1)
        elif backend == "hf":
            result = run_lm_eval("hf", f"pretrained={model_dir},tokenizer={tokenizer_dir},dtype=float32", work, out,
                                 ["--device", "cpu", "--batch_size", "1"], env, args.limit, args.num_fewshot)
        else:
            raise SystemExit(f"Unknown backend {backend!r}")
        report["results"][backend] = result
        print(f"[{backend}] {result['num_requests']} requests in {result['wall_s']} s: "
              f"{result['requests_per_s']} requests/s, acc {result['acc']}", flush=True)
    if {"fastdeploy", "hf"} <= set(report["results"]):
        ours, theirs = report["results"]["fastdeploy"]["chosen"], report["results"]["hf"]["chosen"]
        same = sum(ours[d] == theirs.get(d) for d in ours)
        report["agreement"] = {"same_choice": same, "num_docs": len(ours), "fraction": round(same / max(len(ours), 1), 4)}
        report["speed_ratio_fastdeploy_over_hf"] = round(
            report["results"]["fastdeploy"]["requests_per_s"] / report["results"]["hf"]["requests_per_s"], 3)
        print(f"agreement {same}/{len(ours)}; fastdeploy/hf requests/s = {report['speed_ratio_fastdeploy_over_hf']}")
    for result in report["results"].values():
        result["chosen"] = [result["chosen"][d] for d in sorted(result["chosen"])]
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
        report["before"] = {key: before[key] for key in ("date", "label", "command", "machine", "results",
                                                         "agreement", "speed_ratio_fastdeploy_over_hf")
                            if key in before}
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
