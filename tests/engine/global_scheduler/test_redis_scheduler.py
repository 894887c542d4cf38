"""The Redis global scheduler with a real redis-server: shared queue, work stealing, results home."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from fastdeploy.engine.global_scheduler import (
    GlobalScheduler,
    GlobalSchedulerConfig,
    ScheduledRequest,
    ScheduledResult,
    SchedulerConnectionError,
)


def scheduler(redis_server, name: str, **kwargs) -> GlobalScheduler:
    config = GlobalSchedulerConfig(port=redis_server.port, topic="test", instance_name=name,
                                   heartbeat_interval_s=0.2, instance_expiry_s=1.0, socket_timeout_s=2.0,
                                   connect_timeout_s=1.0, **kwargs)
    return GlobalScheduler(config)


def worker(instance: GlobalScheduler, stop: threading.Event, step_s: float, errors: list) -> None:
    """An engine loop: take one request when idle, 'run' it, send the result (naming the runner)."""
    try:
        while not stop.is_set():
            for request in instance.get_requests(max_num=1, block_s=0.2):
                time.sleep(step_s)
                instance.put_results([ScheduledResult(request.request_id, {"ran_on": instance.name,
                                                                           "echo": request.payload}, True)])
    except Exception as e:  # surfaced by the test
        errors.append(e)


def test_work_submitted_to_one_instance_is_completed_by_both(redis_server):
    a, b = scheduler(redis_server, "A"), scheduler(redis_server, "B")
    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=worker, args=(inst, stop, 0.05, errors), daemon=True) for inst in (a, b)]
    try:
        assert set(a.alive_instances()) == {"A", "B"}
        outcome = a.put_requests([ScheduledRequest(f"r{i}", {"prompt": f"p{i}"}, num_prompt_tokens=3)
                                  for i in range(12)])
        assert all(error is None for _, error in outcome)
        assert a.put_requests([ScheduledRequest("r0", {})]) == [("r0", "duplicate request_id")]
        for t in threads:
            t.start()
        results: dict[str, list] = {}
        deadline = time.monotonic() + 30
        while len(results) < 12 and time.monotonic() < deadline:
            for request_id, items in a.get_results(timeout_s=0.5).items():
                results.setdefault(request_id, []).extend(items)
        assert not errors, errors
        assert sorted(results, key=lambda r: int(r[1:])) == [f"r{i}" for i in range(12)]
        assert all(items[-1].finished and items[-1].payload["echo"] == {"prompt": rid.replace("r", "p")}
                   for rid, items in results.items())
        ran_on = {items[-1].payload["ran_on"] for items in results.values()}
        assert ran_on == {"A", "B"}, "the idle instance should have taken part of the work"
        assert a.pending() == 0 and b.get_results() == {}
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        a.close()
        b.close()


def test_idle_instance_steals_from_the_busiest(redis_server):
    busy, quiet, idle = (scheduler(redis_server, n) for n in ("busy", "quiet", "idle"))
    try:
        busy.put_requests([ScheduledRequest(f"b{i}", i) for i in range(6)])
        quiet.put_requests([ScheduledRequest("q0", 0)])
        busy.report_load(20)
        quiet.report_load(1)
        stolen = idle.get_requests(max_num=8)
        # Half of the busiest backlog, never the whole queue.
        assert [r.request_id for r in stolen] == ["b0", "b1", "b2"]
        assert all(r.origin == "busy" for r in stolen)
        # Its own queue comes first for an instance with work.
        assert [r.request_id for r in quiet.get_requests(max_num=8)] == ["q0"]
        idle.put_results([ScheduledResult("b0", "partial"), ScheduledResult("b0", "done", finished=True)])
        got = busy.get_results(timeout_s=2)
        assert [(r.payload, r.finished) for r in got["b0"]] == [("partial", False), ("done", True)]
    finally:
        for inst in (busy, quiet, idle):
            inst.close()


def test_dead_instance_is_dropped(redis_server):
    a, b = scheduler(redis_server, "A"), scheduler(redis_server, "B")
    try:
        b.put_requests([ScheduledRequest("orphan", None)])
        # B dies without leaving: its heartbeat stops (no close()).
        b._closed.set()
        b._heartbeat.join(5)
        deadline = time.monotonic() + 10
        while "B" in a.alive_instances() or a._call(a._redis.exists, a._key("req", "B")):
            assert time.monotonic() < deadline, "dead instance not dropped"
            time.sleep(0.1)
        assert a.get_requests() == []  # its orphaned requests are not run for nobody
    finally:
        a.close()


def test_redis_down_is_a_clear_error_not_a_hang(redis_server):
    a = scheduler(redis_server, "A")
    try:
        redis_server.stop()
        for call in (lambda: a.put_requests([ScheduledRequest("x", 1)]), lambda: a.get_requests(block_s=5),
                     lambda: a.get_results(timeout_s=5)):
            started = time.monotonic()
            with pytest.raises(SchedulerConnectionError, match=f"cannot reach Redis at 127.0.0.1:{redis_server.port}"):
                call()
            assert time.monotonic() - started < 5
        assert isinstance(SchedulerConnectionError("x"), ConnectionError)
    finally:
        a.close()
    started = time.monotonic()
    with pytest.raises(SchedulerConnectionError, match=f"127.0.0.1:{redis_server.port}.*topic 'test'"):
        scheduler(redis_server, "late")
    assert time.monotonic() - started < 5


def test_config_from_cli_args():
    class Args:
        scheduler_host, scheduler_port, scheduler_topic = "redis.internal", 6380, "pd"
        scheduler_password = None

    config = GlobalSchedulerConfig.from_args(Args())
    assert (config.host, config.port, config.topic, config.password) == ("redis.internal", 6380, "pd", None)


def test_frozen_redis_times_out_instead_of_hanging(redis_server):
    a = scheduler(redis_server, "A")
    os.kill(redis_server.proc.pid, signal.SIGSTOP)  # alive but not answering: only timeouts can help
    try:
        started = time.monotonic()
        with pytest.raises(SchedulerConnectionError, match=f"127.0.0.1:{redis_server.port}"):
            a.get_requests(block_s=30)
        assert time.monotonic() - started < 2.0 + 1.0 + 2.0  # socket timeout, plus slack for a busy machine
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
        a.close()
