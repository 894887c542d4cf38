"""AsyncLLM and the engine core process, with a model-free engine core (fast: no model load)."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine_core import POISON_TOKEN

from fastdeploy.engine.arg_utils import AsyncEngineArgs
from fastdeploy.engine.async_llm import AsyncLLM
from fastdeploy.engine.exceptions import EngineDeadError, EngineGenerateError
from fastdeploy.sampling_params import RequestOutputKind, SamplingParams

FAKE_CORE = "fake_engine_core.FakeEngineCore"


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def fd_config():
    return AsyncEngineArgs(max_model_len=256, disable_log_stats=True).create_engine_config()


def _free_port_pair() -> int:
    """A port p with p + 1 free as well."""
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair")


def _used_blocks(llm: AsyncLLM) -> float:
    return llm.stat_loggers.prometheus.kv_used_blocks._value.get()


async def _settle(llm: AsyncLLM, condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.mark.anyio
async def test_generate_abort_utility_and_death(fd_config):
    # TCP sockets (FastDeploy's --engine-worker-queue-port); the servers in tests/entrypoints use IPC.
    llm = AsyncLLM(fd_config, engine_core_cls=FAKE_CORE, log_stats=False, engine_port=_free_port_pair())
    try:
        # DELTA outputs: the fake model counts up from the last prompt token.
        prompt = {"prompt_token_ids": [10, 11, 12]}
        params = SamplingParams(max_tokens=4, output_kind=RequestOutputKind.DELTA, logprobs=1)
        tokens = []
        async for out in llm.generate(prompt, params, "a"):
            tokens += out.outputs[0].token_ids
            assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
        assert tokens == [13, 14, 15, 16] and out.finished and out.outputs[0].finish_reason == "length"

        # n > 1 with FINAL_ONLY: one output holding every completion.
        params = SamplingParams(max_tokens=3, n=3, temperature=1.0, output_kind=RequestOutputKind.FINAL_ONLY)
        outs = [o async for o in llm.generate(prompt, params, "b")]
        assert len(outs) == 1 and sorted(c.index for c in outs[0].outputs) == [0, 1, 2]

        # Closing a stream early aborts the request and frees its KV blocks.
        params = SamplingParams(max_tokens=200, output_kind=RequestOutputKind.DELTA, ignore_eos=True)
        stream = llm.generate(prompt, params, "c")
        await anext(stream)
        assert _used_blocks(llm) > 0
        await stream.aclose()
        await _settle(llm, lambda: _used_blocks(llm) == 0 and not llm.collectors)
        assert llm.stat_loggers.prometheus.request_success["abort"]._value.get() == 1

        # A duplicate id is refused; a request the engine rejects fails alone, with the engine's reason.
        collector = await llm.add_request("d", prompt, SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="already running"):
            await llm.add_request("d", prompt, SamplingParams(max_tokens=1))
        await llm.abort("d")
        assert collector.get_nowait() is None
        with pytest.raises(EngineGenerateError, match="poisoned request"):
            _ = [o async for o in llm.generate({"prompt_token_ids": [POISON_TOKEN, 1]}, SamplingParams(), "e")]
        assert "e" not in llm.collectors and not llm.output_processor.request_states

        assert await llm.reset_prefix_cache() is True
        await llm.check_health()

        # The engine process dies: in-flight requests fail, health checks and new requests raise.
        dead = asyncio.Event()
        llm.add_dead_listener(lambda error: dead.set())
        params = SamplingParams(max_tokens=200, output_kind=RequestOutputKind.DELTA, ignore_eos=True)
        stream = llm.generate(prompt, params, "f")
        await anext(stream)
        llm.engine_core.proc.kill()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        await asyncio.wait_for(dead.wait(), 5)
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        with pytest.raises(EngineDeadError):
            await llm.add_request("g", prompt, SamplingParams())
    finally:
        llm.shutdown()


@pytest.mark.anyio
async def test_max_log_len_cuts_the_request_log(fd_config):
    """--enable-log-requests with --max-log-len prints at most that many prompt characters and ids (vLLM's)."""
    import logging

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.INFO)
    logger = logging.getLogger("fastdeploy.engine.async_llm")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    llm = AsyncLLM(fd_config, engine_core_cls=FAKE_CORE, log_stats=False, log_requests=True, max_log_len=3)
    try:
        prompt = {"prompt_token_ids": [10, 11, 12, 13, 14, 15]}
        async for _ in llm.generate(prompt, SamplingParams(max_tokens=1), "logged"):
            pass
    finally:
        llm.shutdown()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    added = [line for line in lines if line.startswith("Added request logged")]
    assert len(added) == 1 and added[0].endswith("prompt_token_ids: [10, 11, 12]"), lines


def test_engine_start_failure_is_reported(fd_config):
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        AsyncLLM(fd_config, engine_core_cls="fake_engine_core.NoSuchCore", log_stats=False)


_ORPHAN_SCRIPT = """
import os, sys, time
sys.path[:0] = [{engine_tests!r}, {repo!r}]
from fastdeploy.engine.arg_utils import AsyncEngineArgs
from fastdeploy.engine.async_llm import AsyncLLM

if __name__ == "__main__":
    llm = AsyncLLM(AsyncEngineArgs(max_model_len=256).create_engine_config(),
                   engine_core_cls="fake_engine_core.FakeEngineCore", log_stats=False)
    print(llm.engine_core.proc.pid, flush=True)
    time.sleep(600)
"""


def test_engine_exits_when_the_api_process_dies(tmp_path):
    """A SIGKILLed API process leaves no engine process behind (it notices within a few seconds)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "orphan.py"
    engine_tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(_ORPHAN_SCRIPT.format(engine_tests=engine_tests, repo=os.path.dirname(os.path.dirname(engine_tests))))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(engine_pid)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(engine_pid) and time.monotonic() < deadline:
            if psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.1)
        assert not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == psutil.STATUS_ZOMBIE
    finally:
        if parent.poll() is None:
            parent.kill()
