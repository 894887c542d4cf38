"""The global scheduler inside the engine core process: AsyncLLMs on model-free cores and a real Redis.

Fast (no model): the engine processes run tests/engine's FakeEngineCore, whose "model" counts up
from the last prompt token, 2 ms a step, so every answer is known in advance.
"""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pytest
import zmq
from redis_process import RedisServer, free_port

from fastdeploy.engine.arg_utils import AsyncEngineArgs
from fastdeploy.engine.async_llm import AsyncLLM
from fastdeploy.engine.core_messages import abort_decoder, outputs_decoder, unpack_time
from fastdeploy.engine.exceptions import EngineGenerateError
from fastdeploy.engine.global_scheduler.bridge import BridgeMessage, CoreEndpoint, GlobalSchedulerBridge
from fastdeploy.engine.global_scheduler.redis_scheduler import GlobalSchedulerConfig
from fastdeploy.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from fastdeploy.sampling_params import RequestOutputKind, SamplingParams

FAKE_CORE = "fake_engine_core.FakeEngineCore"
# 900 tokens of 2 ms steps: a request runs for seconds, long enough to act on it midway.
LONG = 900


@pytest.fixture
def anyio_backend():
    return "asyncio"


def make_llm(redis_port: int, max_num_seqs: int) -> AsyncLLM:
    config = AsyncEngineArgs(max_model_len=1024, disable_log_stats=True, max_num_seqs=max_num_seqs,
                             scheduler_name="global", scheduler_port=redis_port,
                             scheduler_topic="bridge-test").create_engine_config()
    return AsyncLLM(config, engine_core_cls=FAKE_CORE, log_stats=False)


def taken(llm: AsyncLLM, source: str) -> float:
    return llm.stat_loggers.prometheus.global_taken[source]._value.get()


def used_blocks(llm: AsyncLLM) -> float:
    return llm.stat_loggers.prometheus.kv_used_blocks._value.get()


async def settle(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def run(llm: AsyncLLM, request_id: str, first_token: int, max_tokens: int) -> list[int]:
    """Stream a request (DELTA) and return its tokens; the fake model answers first_token + 2, + 3, ..."""
    params = SamplingParams(max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA, ignore_eos=True)
    tokens: list[int] = []
    async for out in llm.generate({"prompt_token_ids": [first_token, first_token + 1]}, params, request_id):
        tokens += out.outputs[0].token_ids
    return tokens


def expected(first_token: int, max_tokens: int) -> list[int]:
    return list(range(first_token + 2, first_token + 2 + max_tokens))


@pytest.mark.anyio
async def test_work_submitted_to_one_engine_is_completed_by_both(redis_server):
    a, b = make_llm(redis_server.port, 2), make_llm(redis_server.port, 2)
    try:
        answers = await asyncio.wait_for(
            asyncio.gather(*(run(a, f"r{i}", 1000 * i + 10, 80) for i in range(8))), 60)
        # Every streamed token arrived, in order, whichever engine ran the request.
        assert answers == [expected(1000 * i + 10, 80) for i in range(8)]
        await settle(lambda: taken(a, "own") + taken(b, "stolen") == 8, 5, "take counts")
        assert taken(a, "own") > 0 and taken(b, "stolen") > 0, "the idle engine should have taken part of the work"
        assert taken(a, "stolen") == 0 and taken(b, "own") == 0
        await settle(lambda: used_blocks(a) == 0 and used_blocks(b) == 0, 5, "blocks freed")
        # Requests submitted to the other engine work the same way.
        assert await run(b, "from-b", 5, 10) == expected(5, 10)
    finally:
        a.shutdown()
        b.shutdown()


async def three_long_requests(a: AsyncLLM, b: AsyncLLM) -> list[asyncio.Task]:
    """Three long requests to A (room for one each): A runs one, B steals one, one stays queued."""
    tasks = [asyncio.create_task(run(a, f"long{i}", 100 * i + 10, LONG)) for i in range(3)]
    await settle(lambda: taken(a, "own") == 1 and taken(b, "stolen") == 1, 10, "one request each")
    await settle(lambda: used_blocks(a) > 0 and used_blocks(b) > 0, 5, "both engines running")
    return tasks


@pytest.mark.anyio
async def test_abort_stops_the_request_on_the_engine_that_runs_it(redis_server):
    a, b = make_llm(redis_server.port, 1), make_llm(redis_server.port, 1)
    try:
        tasks = await three_long_requests(a, b)
        started = time.monotonic()
        for task in tasks:
            task.cancel()  # the client goes away: the API aborts its requests
        await asyncio.gather(*tasks, return_exceptions=True)
        # Each request would run LONG steps of 2 ms; the abort reaches B long before.
        await settle(lambda: used_blocks(a) == 0 and used_blocks(b) == 0, 1.5, "aborted requests still running")
        assert time.monotonic() - started < LONG * 0.002
        # The queued one is dropped when taken. Each cancelled task aborts on its own, so A may free
        # its slot and take the queued request just before that request's abort arrives; then the
        # core drops it at once (the blocks check above), so it is counted as taken at most once.
        await asyncio.sleep(0.5)
        assert (taken(a, "stolen"), taken(b, "own"), taken(b, "stolen")) == (0, 0, 1)
        assert taken(a, "own") in (1, 2)
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.anyio
async def test_redis_down_fails_requests_clearly_and_redis_back_serves_again(redis_server):
    a, b = make_llm(redis_server.port, 1), make_llm(redis_server.port, 1)
    address = f"127.0.0.1:{redis_server.port}"
    restarted = None
    try:
        tasks = await three_long_requests(a, b)
        redis_server.stop()
        stopped = time.monotonic()
        # The one B runs and the queued one fail at once, naming Redis; the one A runs goes on.
        done, pending = await asyncio.wait(tasks, timeout=3, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.2)
        failed = [t for t in tasks if t.done()]
        assert len(failed) == 2, f"expected 2 failures within 3 s, got {len(failed)}"
        for task in failed:
            with pytest.raises(EngineGenerateError, match=f"cannot reach Redis at {address}"):
                task.result()
        assert time.monotonic() - stopped < 3
        # A new request fails fast with the same message; the engines stay healthy.
        started = time.monotonic()
        with pytest.raises(EngineGenerateError, match=f"cannot reach Redis at {address}"):
            await asyncio.wait_for(run(a, "while-down", 10, 5), 10)
        assert time.monotonic() - started < 3
        await a.check_health()
        await b.check_health()
        [local] = [t for t in tasks if not t.done()]
        answer = await asyncio.wait_for(local, 30)
        assert answer in [expected(100 * i + 10, LONG) for i in range(3)]
        # Redis comes back (empty): requests are shared again.
        restarted = RedisServer(port=redis_server.port)
        assert await asyncio.wait_for(run(a, "after", 20, 5), 10) == expected(20, 5)
        answers = await asyncio.wait_for(asyncio.gather(*(run(a, f"again{i}", 50 * i, 40) for i in range(4))), 30)
        assert answers == [expected(50 * i, 40) for i in range(4)]
    finally:
        a.shutdown()
        b.shutdown()
        if restarted is not None:
            restarted.stop()


def test_engine_does_not_start_without_redis():
    port = free_port()  # nothing listens there
    with pytest.raises(RuntimeError, match=f"cannot reach Redis at 127.0.0.1:{port}"):
        make_llm(port, 2)


def test_core_endpoint_diverts_stolen_outputs_and_counts_takes():
    ctx = zmq.Context()
    core_side, bridge_side = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    core_side.bind("inproc://endpoint-test")
    bridge_side.connect("inproc://endpoint-test")
    endpoint = CoreEndpoint(core_side)
    try:
        endpoint.taken("own", stolen=False)
        endpoint.taken("stolen", stolen=True)
        outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("own", [1]), EngineCoreOutput("stolen", [2]),
                                             EngineCoreOutput("other", [3])], scheduler_stats=SchedulerStats())
        to_api = endpoint.route(outputs, 12.5)
        assert [o.request_id for o in to_api.outputs] == ["own", "other"]
        stats = to_api.scheduler_stats
        assert (stats.num_global_own_reqs, stats.num_global_stolen_reqs) == (1, 1)
        kind, payload, step_start = bridge_side.recv_multipart()
        assert kind == BridgeMessage.RESULTS.value and unpack_time(step_start) == 12.5
        assert [o.request_id for o in outputs_decoder.decode(payload).outputs] == ["stolen"]
        # Finishing (or aborting) taken requests tells the bridge the core has room again.
        finished = EngineCoreOutputs(outputs=[EngineCoreOutput("stolen", [4], finish_reason=FinishReason.STOP),
                                              EngineCoreOutput("own", [5], finish_reason=FinishReason.LENGTH)],
                                     scheduler_stats=SchedulerStats())
        assert endpoint.route(finished, 13.0).outputs[0].request_id == "own"
        assert finished.scheduler_stats.num_global_own_reqs == 0  # counted once
        assert bridge_side.recv_multipart()[0] == BridgeMessage.RESULTS.value
        kind, payload = bridge_side.recv_multipart()
        assert kind == BridgeMessage.DONE.value and sorted(abort_decoder.decode(payload)) == ["own", "stolen"]
        endpoint.taken("x", stolen=True)
        endpoint.aborted(["x", "unknown"])
        assert [abort_decoder.decode(f) if i else f for i, f in enumerate(bridge_side.recv_multipart())] == \
            [BridgeMessage.DONE.value, ["x"]]
        kind, payload = bridge_side.recv_multipart()
        assert kind == BridgeMessage.ABORT.value and msgspec.msgpack.decode(payload) == ["x", "unknown"]
    finally:
        endpoint.close()
        bridge_side.close(linger=0)
        ctx.term()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_bridge_thread_runs_on_the_io_cores_not_the_engines(redis_server):
    """The engine process is pinned to its cores; the bridge thread alone moves to the API process's."""
    io_core = sorted(os.sched_getaffinity(0))[0]
    before = os.sched_getaffinity(0)
    bridge = GlobalSchedulerBridge(GlobalSchedulerConfig(port=redis_server.port, topic="cores"), capacity=1,
                                   io_cores=frozenset({io_core}))
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.bind("inproc://bridge-cores-output")
    endpoint = bridge.start(ctx, "inproc://bridge-cores-output")
    try:
        thread_id = bridge._thread.native_id
        deadline = time.monotonic() + 5
        while os.sched_getaffinity(thread_id) != {io_core}:
            assert time.monotonic() < deadline, os.sched_getaffinity(thread_id)
            time.sleep(0.01)
        assert os.sched_getaffinity(0) == before  # the calling (engine) thread keeps its cores
    finally:
        assert bridge.close()
        endpoint.close()
        sink.close(linger=0)
        ctx.term()


def test_offline_llm_refuses_the_global_scheduler():
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="--scheduler-name global"):
        LLMEngine(EngineArgs(max_model_len=256, scheduler_name="global").create_engine_config())
