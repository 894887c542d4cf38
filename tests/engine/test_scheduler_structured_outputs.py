"""Scheduler + StructuredOutputManager without a model: grammars compile off the loop, masks, termination."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from fastdeploy.config import CacheConfig, SchedulerConfig, StructuredOutputsConfig
from fastdeploy.engine.request import EngineCoreRequest, FinishReason, Request, RequestStatus
from fastdeploy.engine.sched.scheduler import Scheduler
from fastdeploy.model_executor.guided_decoding import StructuredOutputManager
from fastdeploy.sampling_params import SamplingParams, StructuredOutputsParams
from fastdeploy.worker.model_runner_output import ModelRunnerOutput

EOS = 128  # a character-level vocabulary: token i is chr(i), 128 is the end of text


def make(config: StructuredOutputsConfig | None = None) -> tuple[Scheduler, StructuredOutputManager]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo([chr(i) for i in range(128)] + ["</s>"], xgr.VocabType.RAW, vocab_size=EOS + 1,
                             stop_token_ids=[EOS])
    fd_config = SimpleNamespace(
        structured_outputs_config=config or StructuredOutputsConfig(),
        model_config=SimpleNamespace(vocab_size=EOS + 1),
        scheduler_config=SimpleNamespace(max_num_seqs=8),
    )
    manager = StructuredOutputManager(fd_config, tokenizer=info)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sc.finalize(256)
    cc = CacheConfig(block_size=4)
    cc.num_blocks = 128
    return Scheduler(sc, cc, max_model_len=256, structured_output_manager=manager), manager


def add(s: Scheduler, req_id: str, constraint: StructuredOutputsParams | None = None, **sp) -> Request:
    sp.setdefault("max_tokens", 16)
    core = EngineCoreRequest(req_id, [65, 66, 67], SamplingParams(structured_outputs=constraint, **sp), EOS, time.time())
    request = Request(core, 256)
    s.add_request(request)
    return request


def allowed_tokens(row: np.ndarray) -> np.ndarray:
    bits = np.unpackbits(row.astype("<i4").view(np.uint8), bitorder="little")[: EOS + 1]
    return np.nonzero(bits)[0]


def step(s: Scheduler, default_token: int = ord("z")):
    """One engine step where each constrained request samples its smallest allowed token."""
    so = s.schedule()
    sampled = {}
    for req_id, n in so.num_scheduled_tokens.items():
        req = s.requests[req_id]
        if req.num_computed_tokens + n < req.num_tokens:
            continue
        row = so.structured_output_request_ids.get(req_id)
        sampled[req_id] = [int(allowed_tokens(so.grammar_bitmask[row])[0]) if row is not None else default_token]
    return so, s.update_from_output(so, ModelRunnerOutput(sampled_token_ids=sampled))


def wait_ready(s: Scheduler) -> None:
    deadline = time.time() + 10
    while s.requests_waiting_for_grammar() and time.time() < deadline:
        s.structured_output_manager.wait_for_any(s.requests_waiting_for_grammar(), timeout=0.1)
        for r in s.requests_waiting_for_grammar():
            if r.structured_output_request.is_ready:
                return


def run_to_end(s: Scheduler, max_steps: int = 64) -> dict[str, list]:
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        wait_ready(s)
        _, out = step(s)
        for o in out.outputs:
            outputs.setdefault(o.request_id, []).append(o)
    return outputs


def text_of(outputs) -> str:
    return "".join(chr(t) for o in outputs for t in o.new_token_ids if t != EOS)


def test_grammar_compiles_off_the_loop_while_others_run(monkeypatch):
    s, manager = make()
    release = threading.Event()
    manager._get_backend()
    real_compile = manager._backend.compile
    monkeypatch.setattr(manager._backend, "compile", lambda key: release.wait(10) and real_compile(key))
    constrained = add(s, "c", StructuredOutputsParams(regex="ab[0-9]"))
    add(s, "free")
    assert constrained.status == RequestStatus.WAITING_FOR_FSM
    for _ in range(3):
        so, _ = step(s)
        assert "c" not in so.num_scheduled_tokens and "free" in so.num_scheduled_tokens
        assert so.grammar_bitmask is None
    assert [r.request_id for r in s.waiting] == ["c"]
    release.set()
    outputs = run_to_end(s)
    assert text_of(outputs["c"]) == "ab0"
    assert outputs["c"][-1].finish_reason == FinishReason.STOP and outputs["c"][-1].stop_reason is None


def test_constrained_decoding_masks_and_stops_at_grammar_end():
    s, _ = make()
    add(s, "json", StructuredOutputsParams(json={"type": "object", "properties": {"k": {"enum": ["v"]}},
                                                 "required": ["k"]}, disable_any_whitespace=True))
    add(s, "choice", StructuredOutputsParams(choice=["yes", "no"]))
    # ignore_eos: the grammar's own end still finishes the request.
    add(s, "regex", StructuredOutputsParams(regex="[0-9]{2}"), ignore_eos=True)
    outputs = run_to_end(s)
    assert text_of(outputs["json"]) == '{"k": "v"}'
    assert text_of(outputs["choice"]) == "no"
    assert text_of(outputs["regex"]) == "00"
    assert all(o[-1].finish_reason == FinishReason.STOP for o in outputs.values())


def test_compiled_grammars_are_cached_by_key():
    s, manager = make()
    add(s, "a", StructuredOutputsParams(regex="x+"))
    run_to_end(s)
    second = add(s, "b", StructuredOutputsParams(regex="x+"))
    # Cached: ready at once, nothing to wait for.
    assert second.structured_output_request.is_ready
    assert len(manager._compiled) == 1
    add(s, "c", StructuredOutputsParams(regex="y+"))
    run_to_end(s)
    assert len(manager._compiled) == 2


def test_failed_compilation_aborts_only_that_request(monkeypatch):
    s, manager = make()
    manager._get_backend()

    def broken(key):
        raise RuntimeError("boom")

    monkeypatch.setattr(manager._backend, "compile", broken)
    add(s, "bad", StructuredOutputsParams(regex="a"))
    add(s, "good", max_tokens=2)
    outputs = run_to_end(s)
    assert outputs["bad"][-1].finish_reason == FinishReason.ABORT
    assert outputs["good"][-1].finish_reason == FinishReason.LENGTH
    assert "bad" not in s.requests and not s.waiting


def test_reasoning_is_not_constrained():
    s, manager = make(StructuredOutputsConfig())
    bang = ord("!")
    # A reasoner whose end-of-thinking marker is "!".
    manager.reasoner = SimpleNamespace(is_reasoning_end=lambda ids: bang in ids)
    add(s, "r", StructuredOutputsParams(regex="[0-9]"))
    wait_ready(s)
    so, _ = step(s, default_token=ord("t"))  # thinking: free text
    assert so.grammar_bitmask is None
    so = s.schedule()
    assert so.grammar_bitmask is None
    s.update_from_output(so, ModelRunnerOutput(sampled_token_ids={"r": [bang]}))  # ends the thinking
    outputs = run_to_end(s)
    assert text_of(outputs["r"]) == "0"


def test_scheduler_without_manager_refuses_constraints():
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16)
    sc.finalize(256)
    cc = CacheConfig(block_size=4)
    cc.num_blocks = 8
    s = Scheduler(sc, cc, max_model_len=256)
    with pytest.raises(ValueError, match="StructuredOutputManager"):
        add(s, "x", StructuredOutputsParams(regex="a"))


def test_abort_while_the_grammar_compiles(monkeypatch):
    s, manager = make()
    release = threading.Event()
    manager._get_backend()
    real_compile = manager._backend.compile
    monkeypatch.setattr(manager._backend, "compile", lambda key: release.wait(10) and real_compile(key))
    add(s, "c", StructuredOutputsParams(regex="ab"))
    step(s)
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    release.set()
    assert not s.has_unfinished_requests()
    so, out = step(s)
    assert so.total_num_scheduled_tokens == 0 and out.outputs == []
