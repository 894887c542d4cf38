"""The API process's side of the engine core process: start it, talk to it, notice when it dies."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import tempfile
import threading
import uuid
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for

import zmq
import zmq.asyncio

from fastdeploy import envs
from fastdeploy.config import FDConfig
from fastdeploy.engine.core_messages import (
    EngineCoreOutputType,
    EngineCoreRequestType,
    UtilityCall,
    encoder,
    outputs_decoder,
    unpack_time,
    utility_result_decoder,
)
from fastdeploy.engine.core_proc import EngineCoreProc
from fastdeploy.engine.exceptions import EngineDeadError
from fastdeploy.engine.request import EngineCoreOutputs, EngineCoreRequest
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_binding import CpuBinding, plan_cpu_binding

logger = init_logger(__name__)


def engine_omp_threads() -> int:
    """OMP threads for the engine process: all cores but one, which the HTTP process keeps."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def _int_or(value: str | None, default: int) -> int:
    try:
        return max(1, int(value or ""))
    except ValueError:
        return default


def _socket_addresses(port: int | None) -> tuple[str, str, list[str]]:
    """Input and output socket addresses: TCP on ``port``/``port + 1`` when given, else IPC files."""
    if port is not None:
        return f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", []
    base = os.path.join(tempfile.gettempdir(), f"fd-engine-{uuid.uuid4().hex[:12]}")
    paths = [base + "-in.ipc", base + "-out.ipc"]
    return f"ipc://{paths[0]}", f"ipc://{paths[1]}", paths


class EngineCoreClient:
    """Starts :class:`EngineCoreProc` and exchanges requests and outputs with it over ZMQ.

    Sends are synchronous (a PUSH socket with no high-water mark never blocks);
    receiving is asynchronous. A watcher thread waits on the process sentinel so
    a crash is noticed even while no output is expected.
    """

    def __init__(self, fd_config: FDConfig, *, engine_core_cls: str | None = None, port: int | None = None,
                 omp_threads: int | None = None, ready_timeout_s: float | None = None,
                 engine_cores: frozenset[int] | None = None) -> None:
        self.fd_config = fd_config
        self.dead_error: EngineDeadError | None = None
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._shutting_down = False
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        input_address, output_address, self._ipc_paths = _socket_addresses(port)

        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.SNDHWM, 0)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(input_address)
        self.async_ctx = zmq.asyncio.Context()
        self.output_socket = self.async_ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.RCVHWM, 0)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(output_address)

        # The user's OMP_NUM_THREADS wins; otherwise the engine leaves one core to the HTTP process.
        import fastdeploy

        if fastdeploy.USER_SET_OMP_NUM_THREADS:
            env, threads = {}, _int_or(envs.omp_num_threads(), engine_omp_threads())
        else:
            threads = omp_threads or engine_omp_threads()
            env = {"OMP_NUM_THREADS": str(threads)}
        pc = fd_config.parallel_config
        local_ranks = pc.tensor_parallel_size // pc.nnodes
        if local_ranks > 1:
            # The engine's tensor-parallel ranks split its cores, at least one each.
            threads = max(threads, local_ranks)
        # Where the engine computes and the API process runs (the API side is applied by the server).
        self.cpu_binding = plan_cpu_binding(threads)
        if engine_cores is not None:  # a data-parallel engine: its share of the cores
            self.cpu_binding = CpuBinding(engine_cores, frozenset(os.sched_getaffinity(0)) - engine_cores)
            env = {"OMP_NUM_THREADS": str(len(engine_cores))}
        ready_reader, ready_writer = multiprocessing.Pipe(duplex=False)
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=EngineCoreProc.run_engine_core,
            name="EngineCore",
            args=(fd_config, input_address, output_address, ready_writer, os.getpid(), engine_core_cls,
                  self.cpu_binding),
            # A daemonic process may not start processes: with tensor parallelism the core starts its ranks
            # (it still exits with the API process: it watches its parent).
            daemon=local_ranks == 1,
        )
        with envs.child_environment(env):
            self.proc.start()
        ready_writer.close()
        try:
            self.ready_info = self._wait_until_ready(ready_reader, ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        finally:
            ready_reader.close()
        if self.ready_info.get("num_blocks"):
            fd_config.cache_config.num_blocks = self.ready_info["num_blocks"]
        if self.ready_info.get("kv_transfer_port"):
            fd_config.kv_transfer_config.port = self.ready_info["kv_transfer_port"]
        self._watcher = threading.Thread(target=self._watch_process, name="EngineCoreWatcher", daemon=True)
        self._watcher.start()

    # ---- start-up / liveness ----------------------------------------------------------------
    def _wait_until_ready(self, reader, timeout_s: float | None) -> dict:
        ready = wait_for([reader, self.proc.sentinel], timeout_s)
        if reader in ready:
            try:
                info = reader.recv()
            except EOFError:
                info = {"status": "FAILED", "error": "the engine process closed its start-up pipe"}
            if info.get("status") == "READY":
                return info
            raise RuntimeError(f"Engine core initialization failed: {info.get('error')}. See the log above.")
        if not ready:
            raise TimeoutError(f"The engine core did not become ready within {timeout_s} s.")
        self.proc.join(1)
        raise RuntimeError(
            f"Engine core initialization failed: the process exited with code {self.proc.exitcode}. "
            "See the log above for the root cause."
        )

    def _watch_process(self) -> None:
        wait_for([self.proc.sentinel])
        self.proc.join(1)  # reap it, so the exit code is known
        if not self._shutting_down:
            self._mark_dead(EngineDeadError(
                f"The engine core process died unexpectedly (exit code {self.proc.exitcode}). "
                "See the log above for the root cause.", suppress_context=True))

    def on_dead(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call ``callback(error)`` (from any thread) once the engine core is found dead."""
        self._dead_callbacks.append(callback)
        if self.dead_error is not None:
            callback(self.dead_error)

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self.dead_error is not None:
            return
        self.dead_error = error
        logger.error("%s", error)
        for callback in self._dead_callbacks:
            callback(error)

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.input_socket.send_multipart((EngineCoreRequestType.ADD.value, encoder.encode(request)), copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            self.input_socket.send_multipart((EngineCoreRequestType.ABORT.value, encoder.encode(request_ids)))

    async def call_utility_async(self, method: str, *args) -> object:
        """Run ``EngineCore.<method>(*args)`` in the core process and return its result."""
        self._check_alive()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        self.input_socket.send_multipart(
            (EngineCoreRequestType.UTILITY.value, encoder.encode(UtilityCall(call_id, method, list(args))))
        )
        return await future

    def fail_pending_calls(self, error: BaseException) -> None:
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        self._utility_calls.clear()

    async def get_output_async(self) -> tuple[EngineCoreOutputs, float]:
        """The next step's outputs and the time that step started; answers utility results on the way."""
        while True:
            self._check_alive()
            frames = await self.output_socket.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == EngineCoreOutputType.OUTPUTS.value:
                return outputs_decoder.decode(frames[1].buffer), unpack_time(frames[2].buffer)
            if kind == EngineCoreOutputType.UTILITY.value:
                result = utility_result_decoder.decode(frames[1].buffer)
                future = self._utility_calls.pop(result.call_id, None)
                if future is not None and not future.done():
                    if result.error is None:
                        future.set_result(result.result)
                    else:
                        future.set_exception(RuntimeError(result.error))
            elif kind == EngineCoreOutputType.DEAD.value:
                self._mark_dead(EngineDeadError(f"EngineCore failed: {frames[1].bytes.decode()}",
                                                suppress_context=True))

    # ---- shutdown ---------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the engine process and release the sockets."""
        self._shutting_down = True
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(1)
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self.ctx.term()
        self.async_ctx.term()
        for path in self._ipc_paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
