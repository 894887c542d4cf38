"""Where the engine process computes and the API process runs (fastdeploy/platforms/cpu_binding.py)."""

import os
import subprocess
import sys

import psutil
import pytest

from fastdeploy.platforms.cpu_binding import parse_core_list, plan_cpu_binding
from tests.entrypoints.openai.remote_server import DEFAULT_SERVER_ARGS, RemoteOpenAIServer


def test_auto_gives_the_engine_the_last_cores_and_the_api_the_rest():
    plan = plan_cpu_binding(1, "auto", allowed={0, 1})
    assert plan.engine == {1} and plan.api == {0}
    plan = plan_cpu_binding(3, "auto", allowed={0, 2, 4, 6})
    assert plan.engine == {2, 4, 6} and plan.api == {0}


def test_auto_pins_nothing_when_the_engine_uses_every_core():
    assert plan_cpu_binding(2, "auto", allowed={0, 1}) is None
    assert plan_cpu_binding(1, "nobind", allowed={0, 1}) is None


def test_an_explicit_core_list():
    assert parse_core_list("0-2,5") == {0, 1, 2, 5}
    plan = plan_cpu_binding(1, "0", allowed={0, 1})
    assert plan.engine == {0} and plan.api == {1}


@pytest.mark.parametrize("bad", ["x", "3-1", "-1", "1,,2"])
def test_a_bad_setting_names_the_variable(bad):
    with pytest.raises(ValueError, match="FD_CPU_OMP_THREADS_BIND"):
        plan_cpu_binding(1, bad, allowed={0, 1})


def test_cores_outside_the_allowed_set_are_refused():
    with pytest.raises(ValueError, match="outside"):
        plan_cpu_binding(1, "7", allowed={0, 1})


def _allowed(proc: psutil.Process, zmq_io: bool | None = None) -> set[int]:
    """The cores of the threads of ``proc`` (each thread has its own affinity).

    ``zmq_io`` picks only zmq's own threads (True), only the others (False) or all (None).
    """
    cores: set[int] = set()
    for thread in proc.threads():
        with open(f"/proc/{proc.pid}/task/{thread.id}/comm") as f:
            is_zmq = f.read().startswith("ZMQbg/")
        if zmq_io is None or zmq_io == is_zmq:
            cores |= set(os.sched_getaffinity(thread.id))
    return cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_served_engine_and_its_api_process_run_on_separate_cores():
    """vLLM's VLLM_CPU_OMP_THREADS_BIND spelling, a one-thread engine: each process on its own core."""
    engine_core, api_core = sorted(os.sched_getaffinity(0))[:2]
    env = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(engine_core)}
    server = RemoteOpenAIServer(DEFAULT_SERVER_ARGS, env=env)
    try:
        api = psutil.Process(server.proc.pid)
        engines = [p for p in api.children(recursive=True) if "spawn_main" in " ".join(p.cmdline())]
        assert len(engines) == 1
        # A request runs the engine's OpenMP threads, which must have inherited its core.
        server.get_client().completions.create(model="HuggingFaceTB/SmolLM2-135M-Instruct", prompt="Hi", max_tokens=4)
        assert _allowed(engines[0], zmq_io=False) == {engine_core}
        # zmq's I/O threads wake at every step's send; they belong with the API process.
        assert _allowed(engines[0], zmq_io=True) == {api_core}
        assert engine_core not in _allowed(api) and api_core in _allowed(api)
    finally:
        server.stop()


def test_a_bad_binding_stops_the_server_with_a_clear_message():
    out = subprocess.run(
        [sys.executable, "-m", "fastdeploy.entrypoints.openai.api_server", *DEFAULT_SERVER_ARGS, "--port", "0"],
        env={**os.environ, "OMP_NUM_THREADS": "1", "FD_CPU_OMP_THREADS_BIND": "cores"},
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "FD_CPU_OMP_THREADS_BIND must be" in out.stdout + out.stderr


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_long_steps_widen_to_every_core_while_the_cpu_is_free(tmp_path):
    from fastdeploy._C import OmpControl
    from fastdeploy.platforms.cpu_binding import WIDE_BLOCKTIME_MS, CpuBinding, WideSteps, bind_process

    before = os.sched_getaffinity(0)
    api_core, engine_core = sorted(before)[:2]
    pressure = tmp_path / "cpu"

    def stall(total_us: int) -> None:
        pressure.write_text(f"some avg10=0.00 avg60=0.00 avg300=0.00 total={total_us}\n"
                            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")

    stall(0)
    threads: list[int] = []
    blocktimes: list[int] = []
    clock = _Clock()
    omp = OmpControl(lambda: 1, threads.append, lambda: 200, blocktimes.append)
    steps = WideSteps(CpuBinding(frozenset({engine_core}), frozenset({api_core})), 128, omp,
                      pressure_path=str(pressure), clock=clock)
    bind_process(frozenset({engine_core}), None)
    try:
        steps.for_step(16)  # a decode step stays on the engine's core
        assert not steps.wide and threads == []
        clock.now += 1.0
        steps.for_step(600)  # a prefill, nobody waited for a core: both cores, two threads
        assert steps.wide and threads == [2] and os.sched_getaffinity(0) == {api_core, engine_core}
        steps.for_step(1)
        assert not steps.wide and threads == [2, 1] and os.sched_getaffinity(0) == {engine_core}
        assert blocktimes == [WIDE_BLOCKTIME_MS, 200]  # a wide team's workers sleep soon; narrow: as before
        clock.now += 1.0
        stall(500_000)  # tasks waited for a core half of the last second: stay narrow...
        steps.for_step(600)
        assert not steps.wide and os.sched_getaffinity(0) == {engine_core}
        clock.now += 1.0
        steps.for_step(600)  # ...for the back-off, even once the pressure is gone
        assert not steps.wide
        clock.now += 2.0
        steps.for_step(600)
        assert steps.wide and threads == [2, 1, 2] and steps.num_wide_steps == 2
    finally:
        bind_process(frozenset(before), None)


def test_no_wide_steps_without_cores_to_widen_to_or_when_turned_off():
    from fastdeploy.platforms.cpu_binding import CpuBinding, WideSteps

    assert WideSteps.create(None, 128) is None
    assert WideSteps.create(CpuBinding(frozenset({0, 1}), frozenset()), 128) is None
    assert WideSteps.create(CpuBinding(frozenset({1}), frozenset({0})), 0) is None
