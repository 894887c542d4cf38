"""Scheduler: token budget, chunked prefill, mixing decodes with prefills, preemption, stops."""

import time

from fastdeploy.config import CacheConfig, SchedulerConfig
from fastdeploy.engine.request import EngineCoreRequest, FinishReason, Request
from fastdeploy.engine.sched.scheduler import Scheduler
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.worker.model_runner_output import ModelRunnerOutput


def make_scheduler(num_blocks=64, block_size=4, budget=16, max_num_seqs=8, chunked=True):
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    sc.finalize(256) if chunked else None
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cc.num_blocks = num_blocks
    return Scheduler(sc, cc, max_model_len=256)


def add(s, req_id, n_prompt, **sp):
    sp.setdefault("max_tokens", 4)
    core = EngineCoreRequest(req_id, list(range(100, 100 + n_prompt)), SamplingParams(**sp), 2, time.time())
    s.add_request(Request(core, 256))


def run_step(s, token=7):
    so = s.schedule()
    sampled = {}
    for req_id, n in so.num_scheduled_tokens.items():
        req = s.requests[req_id]
        if req.num_computed_tokens + n >= req.num_tokens:
            sampled[req_id] = [token]
    return so, s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))


def test_chunked_prefill_respects_budget_and_mixes_with_decodes():
    s = make_scheduler(budget=16)
    add(s, "a", 6)
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 6}
    add(s, "b", 40)
    so, out = run_step(s)
    # a decodes (1 token) while b prefills the remaining 15 of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [o.request_id for o in out.outputs] == ["a"]
    so, _ = run_step(s)
    assert so.num_scheduled_tokens["b"] == 15 and so.total_num_scheduled_tokens <= 16


def test_preemption_by_recompute_when_blocks_run_out():
    s = make_scheduler(num_blocks=8, block_size=4, budget=64)
    add(s, "a", 8, max_tokens=20, ignore_eos=True)
    add(s, "b", 8, max_tokens=20, ignore_eos=True)
    preempted = set()
    finished = {}
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        so, out = run_step(s)
        preempted |= so.preempted_req_ids
        for o in out.outputs:
            if o.finished:
                finished[o.request_id] = o.finish_reason
    assert preempted, "the pool of 8 blocks cannot hold both requests to the end"
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert s.kv_cache_manager.num_used_blocks == 0


def test_stop_conditions():
    s = make_scheduler()
    add(s, "eos", 4, max_tokens=10)
    add(s, "stop_id", 4, max_tokens=10, stop_token_ids=[7])
    add(s, "min", 4, max_tokens=10, min_tokens=3, stop_token_ids=[7])
    results = {}
    for _ in range(10):
        so = s.schedule()
        sampled = {r: [2 if r == "eos" else 7] for r in so.num_scheduled_tokens}
        for o in s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled)).outputs:
            if o.finished:
                results[o.request_id] = (o.finish_reason, o.stop_reason, s_len(o))
        if not s.has_unfinished_requests():
            break
    assert results["eos"][:2] == (FinishReason.STOP, None)
    assert results["stop_id"][:2] == (FinishReason.STOP, 7)
    assert results["min"][:2] == (FinishReason.STOP, 7)


def s_len(o):
    return len(o.new_token_ids)


def test_abort_frees_blocks():
    s = make_scheduler()
    add(s, "a", 10)
    run_step(s)
    assert s.kv_cache_manager.num_used_blocks > 0
    from fastdeploy.engine.request import RequestStatus

    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_used_blocks == 0
    assert "a" in s.schedule().finished_req_ids
