"""lm-eval's ``local-completions`` against the server gives, per sample, what ``LLM`` computes directly.

A loglikelihood (multiple-choice) task exercises echo + logprobs; a generate_until
task exercises greedy generation with stop sequences. lm-eval reads the tokenizer
through the server's /tokenizer_info and /tokenize (its "remote" backend).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from remote_server import MODEL_NAME

from fastdeploy import SamplingParams

pytestmark = pytest.mark.slow

MC_DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "The capital of Germany is", "choices": ["Madrid", "Berlin", "Rome"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Celsius", "Fahrenheit"], "answer": 0},
    {"question": "The largest planet in the solar system is", "choices": ["Mars", "Venus", "Jupiter"], "answer": 2},
]
GEN_DOCS = [
    {"question": "What color is the sky on a clear day?", "answer": "blue"},
    {"question": "Name a fruit that is yellow.", "answer": "banana"},
]
TASKS = {
    "fd_mc": """task: fd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "fd_gen": """task: fd_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""",
}


def _run_lm_eval(server, tmp_path) -> dict[str, list[dict]]:
    for name, docs in (("fd_mc", MC_DOCS), ("fd_gen", GEN_DOCS)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tmp_path / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    env = {**os.environ, "OPENAI_API_KEY": server.api_key, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
    model_args = f"model={MODEL_NAME},base_url={server.url_for('v1', 'completions')},num_concurrent=1,max_retries=1"
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "fd_mc,fd_gen", "--include_path", str(tmp_path), "--log_samples",
           "--output_path", str(tmp_path / "out")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    samples = {}
    for name in ("fd_mc", "fd_gen"):
        (path,) = (tmp_path / "out").rglob(f"samples_{name}_*.jsonl")
        samples[name] = sorted((json.loads(line) for line in path.read_text().splitlines()),
                               key=lambda s: s["doc_id"])
    return samples


def _loglikelihood(llm, context: str, continuation: str) -> float:
    """log P(continuation | context), tokenized as lm-eval does (context, then the whole string)."""
    tokenizer = llm.get_tokenizer()
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": whole}, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return sum(out.prompt_logprobs[i][whole[i]].logprob for i in range(len(context_ids), len(whole)))


def test_lm_eval_local_completions_matches_llm(server, smol_llm, tmp_path):
    pytest.importorskip("lm_eval")
    samples = _run_lm_eval(server, tmp_path)

    for sample, doc in zip(samples["fd_mc"], MC_DOCS, strict=True):
        served = [float(resp[0][0]) for resp in sample["resps"]]
        direct = [_loglikelihood(smol_llm, doc["question"], " " + choice) for choice in doc["choices"]]
        assert served == pytest.approx(direct, abs=2e-3)
        assert served.index(max(served)) == direct.index(max(direct))

    for sample, doc in zip(samples["fd_gen"], GEN_DOCS, strict=True):
        prompt = f"Question: {doc['question']}\nAnswer:"
        direct = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=["\n"]),
                                   use_tqdm=False)[0].outputs[0].text
        assert sample["resps"][0][0] == direct
