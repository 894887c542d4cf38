"""The scheduler with drafts: budget, KV slots, rollback of rejected positions, stops inside a run."""

import time

from fastdeploy.config import CacheConfig, SchedulerConfig
from fastdeploy.engine.request import EngineCoreRequest, Request
from fastdeploy.engine.sched.scheduler import Scheduler
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.spec_decode.config import SpeculativeConfig
from fastdeploy.worker.model_runner_output import ModelRunnerOutput


def make_scheduler(budget=16, method="ngram", num_blocks=64):
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, enable_chunked_prefill=True)
    sc.finalize(256)
    cc = CacheConfig(block_size=4, enable_prefix_caching=True)
    cc.num_blocks = num_blocks
    extra = {"model": "/unused"} if method == "draft_model" else {}
    spec = SpeculativeConfig.from_dict({"method": method, "num_speculative_tokens": 3, **extra})
    return Scheduler(sc, cc, max_model_len=256, speculative_config=spec)


def add(s, req_id, n_prompt, **sp):
    sp.setdefault("max_tokens", 20)
    sp.setdefault("ignore_eos", True)
    core = EngineCoreRequest(req_id, list(range(100, 100 + n_prompt)), SamplingParams(**sp), 2, time.time())
    s.add_request(Request(core, 256))


def step(s, sampled, drafts=None):
    so = s.schedule()
    return so, s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=drafts or {}))


def test_drafts_count_against_the_budget_and_roll_back():
    s = make_scheduler(budget=16)
    add(s, "a", 6)
    so, _ = step(s, {"a": [7]}, {"a": [8, 9, 10]})
    req = s.requests["a"]
    assert req.spec_token_ids == [8, 9, 10]
    so, out = step(s, {"a": [8, 11]}, {"a": [12, 13, 14]})  # d1 accepted, d2 rejected -> 11
    # Last token + 3 drafts scheduled; the drafts verified are the scheduler's.
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [8, 9, 10]}
    assert out.outputs[0].new_token_ids == [8, 11]
    # 6 prompt + 7, 8 computed; 11 is the new last token; the rejected 9, 10 positions are given back.
    assert req.num_tokens == 9 and req.num_computed_tokens == 8
    assert out.scheduler_stats.spec_decoding_stats.num_accepted_tokens_per_pos == [1, 0, 0]


def test_budget_cuts_drafts():
    s = make_scheduler(budget=3)
    add(s, "a", 3)
    step(s, {"a": [7]}, {"a": [8, 9, 10]})
    so, _ = step(s, {"a": [8, 9]})
    assert so.num_scheduled_tokens == {"a": 3} and so.scheduled_spec_decode_tokens == {"a": [8, 9]}


def test_stop_inside_a_verified_run_truncates_it():
    s = make_scheduler()
    add(s, "a", 6, ignore_eos=False)
    step(s, {"a": [7]}, {"a": [8, 2, 10]})
    _, out = step(s, {"a": [8, 2, 10, 11]})  # EOS (2) accepted mid-run
    assert out.outputs[0].new_token_ids == [8, 2] and out.outputs[0].finish_reason is not None


def test_drafts_never_pass_max_tokens():
    s = make_scheduler()
    add(s, "a", 6, max_tokens=3)
    step(s, {"a": [7]}, {"a": [8, 9, 10]})
    assert s.requests["a"].spec_token_ids == [8]  # 1 output so far, 3 allowed: the bonus token is the third


def test_draft_model_lookahead_slots_are_allocated():
    s = make_scheduler(method="draft_model")
    add(s, "a", 8)
    step(s, {"a": [7]})
    # 8 prompt tokens + 3 lookahead slots for the draft's steps: 3 blocks of 4.
    assert len(s.kv_cache_manager.get_block_ids("a")) == 3


def test_preemption_drops_drafts():
    s = make_scheduler()
    add(s, "a", 6)
    step(s, {"a": [7]}, {"a": [8, 9]})
    s._preempt(s.running.pop())
    assert s.requests["a"].spec_token_ids == [] and s.requests["a"].num_computed_tokens == 0
