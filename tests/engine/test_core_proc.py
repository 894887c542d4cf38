"""The engine core process's own threads: where zmq's I/O thread runs."""

from __future__ import annotations

import os
import time

import pytest

from fastdeploy.engine.core_proc import EngineCoreProc


def _zmq_io_threads() -> list[int]:
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("ZMQbg/IO"):
                    tids.append(int(tid))
        except FileNotFoundError:  # a thread that just ended
            continue
    return tids


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell the sets apart")
def test_zmq_io_thread_runs_on_the_io_cores(tmp_path):
    io_core = min(os.sched_getaffinity(0))
    before = set(_zmq_io_threads())
    proc = EngineCoreProc(object(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out", os.getpid(),
                          io_cores=frozenset({io_core}))
    try:
        # The thread names itself (and sets its affinity) once running, a moment after the socket
        # that starts it: a look straight after the constructor can come before that.
        deadline = time.monotonic() + 5
        while not (started := [tid for tid in _zmq_io_threads() if tid not in before]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started, "the context's I/O thread did not start with its sockets"
        assert all(os.sched_getaffinity(tid) == {io_core} for tid in started)
        assert len(os.sched_getaffinity(0)) >= 2  # the caller's own binding is untouched
    finally:
        proc.close()
