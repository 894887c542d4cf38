"""Throughput cost of JSON-schema decoding (xgrammar bitmask) vs unconstrained decoding, same prompts.

Both runs decode exactly ``--output-len`` tokens per request (the schema needs
more, so constrained requests end on length like the ``ignore_eos`` baseline),
so the batch shape is identical and the ratio is the per-token price of the
grammar: the batched bitmask fill, its application in the sampler, and the
matcher advancing over each token. Grammar compilation is measured apart.

    python benchmarks/benchmark_structured_outputs.py --num-prompts 16 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

# A list of records: every token of the output is under the grammar (strings, integers, enums, nesting).
SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "active"],
    },
}
TOPICS = ["users", "books", "cities", "cars", "songs", "planets", "fruits", "tools"]


class Timer:
    """Accumulated wall time of one function, patched in place."""

    def __init__(self, owner, name: str) -> None:
        self.seconds = 0.0
        self.calls = 0
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "structured_outputs.json"))
    args = parser.parse_args()

    from fastdeploy import LLM, SamplingParams, StructuredOutputsParams
    from fastdeploy.model_executor.guided_decoding import backend_xgrammar
    from fastdeploy.model_executor.guided_decoding import manager as so_manager
    from fastdeploy.model_executor.layers import sampler as sampler_module

    llm = LLM(max_model_len=2048, max_num_seqs=max(args.num_prompts, 8), kv_cache_memory_bytes=1 << 30)
    tokenizer = llm.get_tokenizer()
    prompts = []
    for i in range(args.num_prompts):
        question = f"List some {TOPICS[i % len(TOPICS)]} as JSON records with id, name, tags and active."
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        prompts.append({"prompt_token_ids": list(ids)})

    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def constrained() -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=args.output_len,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA))

    # Warm-up, and the one-off costs: backend (tokenizer info) + first compilation, then a cached start.
    llm.generate(prompts[:2], free, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                 use_tqdm=False)
    first_request_s = time.perf_counter() - t0
    fresh = {**SCHEMA, "minItems": 41}  # a new key: compilation only, the backend exists
    t0 = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=fresh)),
                 use_tqdm=False)
    new_schema_request_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                 use_tqdm=False)
    cached_schema_request_s = time.perf_counter() - t0

    fill = Timer(so_manager.StructuredOutputManager, "grammar_bitmask")
    apply = Timer(sampler_module, "apply_token_bitmask")
    advance = Timer(backend_xgrammar.XgrammarGrammar, "accept_tokens")

    def run(params) -> dict:
        wall, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
                "tokens": sum(len(o.outputs[0].token_ids) for o in outs), "outs": outs}

    # Back-to-back pairs; each pair's ratio cancels slow drifts of a shared machine, the median the outliers.
    # CPU time (this process, all threads) is also reported: other processes on the machine barely move it.
    pairs = []
    for _ in range(args.repeats):
        base = run(free)
        fill.seconds = apply.seconds = advance.seconds = 0.0
        guided = run(constrained())
        guided["fill_s"], guided["apply_s"], guided["advance_s"] = fill.seconds, apply.seconds, advance.seconds
        pairs.append((base, guided))

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    def tps(r: dict, clock: str) -> float:
        return r["tokens"] / r[clock]

    wall_ratio = median([tps(g, "wall_s") / tps(b, "wall_s") for b, g in pairs])
    cpu_ratio = median([tps(g, "cpu_s") / tps(b, "cpu_s") for b, g in pairs])
    base, guided = min(pairs, key=lambda p: p[0]["wall_s"] + p[1]["wall_s"])
    outs = guided["outs"]
    result = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF)",
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "schema": "array of >= 40 records {id: int 0-9999, name: str <= 12, tags: enum[] <= 3, active: bool}",
        "repeats": args.repeats,
        "unconstrained": {"elapsed_s": round(base["wall_s"], 3), "cpu_s": round(base["cpu_s"], 3),
                          "output_tokens": base["tokens"], "output_tokens_per_s": round(tps(base, "wall_s"), 1)},
        "json_schema": {"elapsed_s": round(guided["wall_s"], 3), "cpu_s": round(guided["cpu_s"], 3),
                        "output_tokens": guided["tokens"], "output_tokens_per_s": round(tps(guided, "wall_s"), 1),
                        "bitmask_fill_s": round(guided["fill_s"], 3), "bitmask_apply_s": round(guided["apply_s"], 3),
                        "matcher_advance_s": round(guided["advance_s"], 3)},
        # The grammar's own work per run, timed directly: what the ratio costs on a quiet machine.
        "measured_grammar_overhead_fraction": round(
            (guided["fill_s"] + guided["apply_s"] + guided["advance_s"]) / guided["wall_s"], 4),
        # Median over back-to-back pairs of (JSON tokens/s) / (unconstrained tokens/s).
        "throughput_ratio_json_vs_unconstrained": round(wall_ratio, 3),
        "cpu_throughput_ratio_json_vs_unconstrained": round(cpu_ratio, 3),
        "one_off": {"first_constrained_request_s": round(first_request_s, 3),
                    "new_schema_request_s": round(new_schema_request_s, 3),
                    "cached_schema_request_s": round(cached_schema_request_s, 3)},
        "sample_output": outs[0].outputs[0].text[:200],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_after": os.getloadavg()[0],
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
