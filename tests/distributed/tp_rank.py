"""One tensor-parallel rank of the model-level TP tests, run as its own process.

Each rank joins a gloo group of ``world`` ranks (the engine's DistributedInit), builds each
model of the job list (its layers split over the group as they are built) and runs the same
paged prefill + greedy decode as the TP=1 reference in the test; rank 0 saves the results.
"""

from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_jobs(jobs: list[dict], max_new_tokens: int) -> dict[str, dict]:
    """Per job: prefill logits of each prompt, and (unless the job is ``prefill_only``) the greedy continuation with
    its first step's logits."""
    from tests.model_executor.utils import greedy_generate, prefill_logits

    results = {}
    for job in jobs:
        model = _load(job)
        out = {"logits": [], "tokens": [], "first": [], "num_kv_heads": model.num_kv_heads}
        for prompt in job["prompts"]:
            out["logits"].append(prefill_logits(model, prompt))
            if job.get("prefill_only"):
                continue
            tokens, first = greedy_generate(model, prompt, max_new_tokens, prefill_chunk=job.get("prefill_chunk"))
            out["tokens"].append(tokens)
            out["first"].append(first)
        results[job["name"]] = out
    return results


def _load(job: dict):
    """The job's model in fp32; ``quantization`` (e.g. "gguf": the GGUF blocks, sharded) when the job names one."""
    from fastdeploy.config import LoadConfig, ModelConfig
    from fastdeploy.model_executor.model_loader import get_model

    model = os.path.join(job["path"], job["gguf_file"]) if job.get("gguf_file") else job["path"]
    return get_model(ModelConfig(model=model, dtype="float32", quantization=job.get("quantization")), LoadConfig())


def rank_main(rank: int, world: int, port: int, jobs: list[dict], max_new_tokens: int, out_path: str) -> None:
    from fastdeploy.distributed.parallel_state import DistributedInit, init_distributed_environment

    init_distributed_environment(DistributedInit(rank, world, "127.0.0.1", port))
    results = run_jobs(jobs, max_new_tokens)
    if rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)


def run_tensor_parallel(jobs: list[dict], world: int, max_new_tokens: int, out_path: str,
                        timeout_s: float = 600) -> dict[str, dict]:
    """Run ``jobs`` on ``world`` rank processes; rank 0's results."""
    import multiprocessing

    from fastdeploy.executor.multiproc_executor import free_port_pair

    port = free_port_pair()
    mp = multiprocessing.get_context("spawn")
    procs = [mp.Process(target=rank_main, args=(r, world, port, jobs, max_new_tokens, out_path))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    if codes != [0] * world:
        raise RuntimeError(f"tensor-parallel ranks exited with {codes}")
    with open(out_path, "rb") as f:
        return pickle.load(f)
