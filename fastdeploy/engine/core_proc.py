"""EngineCoreProc: the engine core in a process of its own, fed and drained over ZMQ.

The loop is the hot path: it only moves msgpack frames and calls ``EngineCore``;
all text work (tokenizing, detokenizing, stop strings, JSON) stays in the API
process.
"""

from __future__ import annotations

import importlib
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from fastdeploy import envs
from fastdeploy.config import FDConfig
from fastdeploy.engine.core_messages import (
    UTILITY_METHODS,
    EngineCoreOutputType,
    EngineCoreRequestType,
    UtilityCall,
    UtilityResult,
    abort_decoder,
    encoder,
    pack_time,
    request_decoder,
    utility_call_decoder,
)
from fastdeploy.engine.global_scheduler.bridge import BridgeMessage, CoreEndpoint, GlobalSchedulerBridge
from fastdeploy.engine.request import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_binding import CpuBinding, WideSteps, bind_process

logger = init_logger(__name__)

DEFAULT_ENGINE_CORE_CLS = "fastdeploy.engine.core.EngineCore"
# How often an idle core wakes up to check that the API process is still alive.
_IDLE_POLL_MS = 1000


def _load_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


class EngineCoreProc:
    """Runs ``engine_core`` in a busy loop: drain requests, step while there is work, push outputs."""

    def __init__(self, engine_core: Any, input_address: str, output_address: str, parent_pid: int,
                 bridge: GlobalSchedulerBridge | None = None, io_cores: frozenset[int] | None = None) -> None:
        self.engine_core = engine_core
        self.parent_pid = parent_pid
        self.ctx = zmq.Context(io_threads=1)
        # zmq's I/O thread starts with the first socket and would inherit the engine's cores,
        # waking on them at every step's send; on the API process's cores (``io_cores``) it
        # leaves the engine's threads alone. Set before any socket exists, or it does not apply.
        for core in sorted(io_cores or ()):
            self.ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, core)
        self.input_socket = self.ctx.socket(zmq.PULL)
        self.input_socket.setsockopt(zmq.RCVHWM, 0)
        self.input_socket.connect(input_address)
        self.output_socket = self.ctx.socket(zmq.PUSH)
        self.output_socket.setsockopt(zmq.SNDHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, 1000)
        self.output_socket.connect(output_address)
        self.poller = zmq.Poller()
        self.poller.register(self.input_socket, zmq.POLLIN)
        # --scheduler-name global: requests go through Redis (the bridge) before they reach the core.
        self.bridge = bridge
        self.bridge_end: CoreEndpoint | None = None
        if bridge is not None:
            self.bridge_end = bridge.start(self.ctx, output_address)
            self.poller.register(self.bridge_end.socket, zmq.POLLIN)
        # Set when an abort or a utility call changed the KV usage while nothing runs, so one
        # stats-only output still tells the API process (e.g. "no blocks in use").
        self._stats_dirty = False

    # ---- process entry point --------------------------------------------------------------
    @staticmethod
    def run_engine_core(fd_config: FDConfig, input_address: str, output_address: str, ready_conn: Connection,
                        parent_pid: int, engine_core_cls: str | None = None,
                        cpu_binding: CpuBinding | None = None) -> None:
        """Target of the engine core process: build the core, report ready, loop until told to stop.

        ``cpu_binding``: the engine's cores (fastdeploy/platforms/cpu_binding.py), set before any
        OpenMP thread starts so that every one of them inherits it, and the API process's, which
        long steps may use too (``WideSteps``).
        """
        if cpu_binding is not None:
            bind_process(cpu_binding.engine, "EngineCore")
        # Ctrl-C reaches the whole process group; the API process decides when the core stops.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _raise_system_exit)
        proc: EngineCoreProc | None = None
        bridge: GlobalSchedulerBridge | None = None
        exit_code = 0
        try:
            try:
                # Before the model loads, so an unreachable Redis fails the start at once.
                bridge = GlobalSchedulerBridge.from_config(fd_config, cpu_binding.api if cpu_binding else None)
                core = _load_class(engine_core_cls or DEFAULT_ENGINE_CORE_CLS)(fd_config)
                if hasattr(core, "wide_steps"):
                    # After the model loaded: the kernels' OpenMP runtime is in the process now.
                    core.wide_steps = WideSteps.create(cpu_binding, envs.cpu_wide_step_tokens())
            except BaseException as e:
                if bridge is not None:
                    bridge.close()
                ready_conn.send({"status": "FAILED", "error": f"{type(e).__name__}: {e}"})
                raise
            proc = EngineCoreProc(core, input_address, output_address, parent_pid, bridge,
                                  cpu_binding.api if cpu_binding else None)
            watch_ranks = getattr(getattr(core, "worker", None), "watch_ranks", None)
            if watch_ranks is not None:  # tensor-parallel ranks: one dying while idle fails the engine too
                watch_ranks(proc.die)
            ready_conn.send({"status": "READY", "num_blocks": fd_config.cache_config.num_blocks,
                             "kv_transfer_port": fd_config.kv_transfer_config.port})
            ready_conn.close()
            proc.run_busy_loop()
        except SystemExit:
            logger.debug("EngineCore exiting.")
        except BaseException as e:
            exit_code = 1
            logger.error("EngineCore failed:\n%s", traceback.format_exc())
            if proc is not None:
                proc.send_dead(f"{type(e).__name__}: {e}")
        finally:
            if proc is not None:
                proc.close()
        if exit_code:
            os._exit(exit_code)

    # ---- the loop -------------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        """Drain the input socket, run one step when there is work, send its outputs; forever."""
        core = self.engine_core
        while True:
            self._process_input_queue()
            if core.has_unfinished_requests() or self._stats_dirty:
                self._stats_dirty = False
                start = time.time()
                outputs = core.step()
                self._send_outputs(outputs, start)

    def _process_input_queue(self) -> None:
        if not self.engine_core.has_unfinished_requests() and not self._stats_dirty:
            # Idle: block until a request arrives, checking now and then that the API process lives.
            while not self.poller.poll(_IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    logger.info("The API process is gone; EngineCore exits.")
                    raise SystemExit(0)
        sock = self.input_socket
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._handle_request(frames[0].bytes, frames[1].buffer)
        if self.bridge_end is not None:
            self._process_bridge_queue()

    def _handle_request(self, kind: bytes, payload: memoryview) -> None:
        core = self.engine_core
        if kind == EngineCoreRequestType.ADD.value:
            if self.bridge_end is not None:
                self.bridge_end.submit(payload)  # into Redis; it comes back when this instance takes it
            else:
                self._add_request(request_decoder.decode(payload))
        elif kind == EngineCoreRequestType.ABORT.value:
            request_ids = abort_decoder.decode(payload)
            core.abort_requests(request_ids)
            if self.bridge_end is not None:
                self.bridge_end.aborted(request_ids)
            self._stats_dirty = True
        elif kind == EngineCoreRequestType.UTILITY.value:
            self._handle_utility(utility_call_decoder.decode(payload))
        else:
            logger.error("Unknown request type %r ignored.", kind)

    def _add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.engine_core.add_request(request)
        except Exception as e:
            # Reject this request alone; the engine keeps serving the others.
            logger.error("Request %s rejected by the engine: %s", request.request_id, e)
            rejected = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT, error=str(e))
            self._send_outputs(EngineCoreOutputs(outputs=[rejected], timestamp=time.time()), time.time())

    def _process_bridge_queue(self) -> None:
        """Requests the global scheduler hands this core to run, and ones to drop."""
        endpoint = self.bridge_end
        while True:
            try:
                frames = endpoint.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            kind = frames[0].bytes
            if kind == BridgeMessage.RUN.value:
                request = request_decoder.decode(frames[1].buffer)
                endpoint.taken(request.request_id, stolen=frames[2].bytes == b"1")
                self._add_request(request)
            elif kind == BridgeMessage.CANCEL.value:
                request_ids = abort_decoder.decode(frames[1].buffer)
                self.engine_core.abort_requests(request_ids)
                endpoint.cancelled(request_ids)
                self._stats_dirty = True

    def _handle_utility(self, call: UtilityCall) -> None:
        result = UtilityResult(call.call_id)
        try:
            if call.method not in UTILITY_METHODS:
                raise ValueError(f"Unknown engine core method {call.method!r}.")
            result.result = True if call.method == "ping" else getattr(self.engine_core, call.method)(*call.args)
        except Exception as e:
            result.error = f"{type(e).__name__}: {e}"
        self._stats_dirty = True
        self.output_socket.send_multipart((EngineCoreOutputType.UTILITY.value, encoder.encode(result)), copy=False)

    def _send_outputs(self, outputs: EngineCoreOutputs, step_start: float) -> None:
        if self.bridge_end is not None:
            outputs = self.bridge_end.route(outputs, step_start)
        self.output_socket.send_multipart(
            (EngineCoreOutputType.OUTPUTS.value, encoder.encode(outputs), pack_time(step_start)), copy=False
        )

    # ---- shutdown -------------------------------------------------------------------------
    def die(self, message: str) -> None:
        """Fail the engine from any thread: tell the API process why, then exit non-zero."""
        logger.error("EngineCore failed: %s", message)
        self.send_dead(message)
        time.sleep(0.2)  # let the message leave
        os._exit(1)

    def send_dead(self, message: str) -> None:
        """Tell the API process the core cannot go on (best effort)."""
        try:
            self.output_socket.send_multipart((EngineCoreOutputType.DEAD.value, message.encode()), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        shutdown = getattr(self.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        # A bridge thread stuck in a Redis call keeps its sockets: then the context is not
        # terminated (that would wait for it); the process is exiting anyway.
        terminate = True
        if self.bridge is not None:
            terminate = self.bridge.close()
            self.bridge_end.close()
        self.input_socket.close(linger=0)
        self.output_socket.close()
        if terminate:
            self.ctx.term()


def _raise_system_exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)
