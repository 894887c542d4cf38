"""Tensor parallelism across processes: the engine core drives one worker process per rank (vLLM's shape).

:class:`MultiprocExecutor` stands where the engine core's in-process :class:`Worker` stands
(same methods). It starts the ranks of this node as processes, each pinned to its share of
the cores with as many OpenMP threads, and talks to every rank, local or on another node,
over one ZMQ ROUTER socket: each step's scheduler output goes to all ranks, and rank 0
alone answers with the sampled tokens (every rank samples the same logits after the LM
head's all-gather; rank 0's tokens are broadcast so the ranks' batches never drift apart).
The ranks' own collectives (the all-reduces of the row-parallel layers, the gathers) run on
paddle.distributed in a world of their own, whose store is ``master_addr:master_port``; the
executor's socket is the next port.

A rank that dies, or fails a call, fails the engine: the executor raises, the engine core
reports itself dead (the API server's /health turns 503 and it exits non-zero), and every
other rank is stopped.

Multi-node (vLLM's ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--master-port``): the
head node (rank 0) runs the engine and its share of the ranks; every other node runs
``fastdeploy serve MODEL --headless --node-rank K ...``, which starts only its ranks
(:func:`run_headless`) and waits for them; they connect to the head's executor socket.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from fastdeploy import envs
from fastdeploy.config import FDConfig
from fastdeploy.distributed.parallel_state import DistributedInit, init_distributed_environment
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_binding import bind_process, plan_rank_cores

logger = init_logger(__name__)

# Seconds between liveness checks of the local ranks while the executor waits for an answer.
_POLL_S = 0.2
# Seconds the ranks get to start (join the group, load the model) before the engine gives up.
_START_TIMEOUT_S = 900.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank exited or failed; the engine cannot go on."""


@dataclass(frozen=True)
class NodeLayout:
    """Which ranks of a ``world_size`` group run on node ``node_rank`` of ``nnodes``."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank ({self.node_rank}) must be in [0, --nnodes={self.nnodes}).")
        if self.world_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size ({self.world_size}) must be a multiple of --nnodes "
                             f"({self.nnodes}): each node runs the same number of ranks.")

    @property
    def local_ranks(self) -> range:
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def executor_address(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port + 1}"


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free on ``host`` (the store and the executor's socket)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind((host, port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("No two consecutive free ports for the tensor-parallel group.")


def node_layout(fd_config: FDConfig) -> NodeLayout:
    """The layout from the parallel config, with a free master port picked on one node when none was given."""
    pc = fd_config.parallel_config
    port = pc.master_port or (free_port_pair(pc.master_addr) if pc.nnodes == 1 else 0)
    if not port:
        raise ValueError("--master-port is required with --nnodes > 1 (every node must find the head there).")
    return NodeLayout(pc.tensor_parallel_size, pc.nnodes, pc.node_rank, pc.master_addr, port)


def start_local_ranks(fd_config: FDConfig, layout: NodeLayout) -> list[multiprocessing.Process]:
    """Start this node's ranks, each pinned to its share of the cores with that many OpenMP threads."""
    ranks = list(layout.local_ranks)
    cores = plan_rank_cores(len(ranks))
    mp = multiprocessing.get_context("spawn")
    procs = []
    for rank, rank_cores in zip(ranks, cores, strict=True):
        init = DistributedInit(rank, layout.world_size, layout.master_addr, layout.master_port,
                               _dist_backend())
        proc = mp.Process(target=worker_main, name=f"TPWorker-{rank}",
                          args=(fd_config, init, layout.executor_address, rank_cores, os.getpid()), daemon=True)
        with envs.child_environment({"OMP_NUM_THREADS": str(len(rank_cores))}):
            proc.start()
        procs.append(proc)
    logger.info("Started tensor-parallel ranks %s of %d on this node (cores %s).", ranks, layout.world_size,
                " | ".join(",".join(map(str, sorted(c))) for c in cores))
    return procs


def _dist_backend() -> str:
    from fastdeploy.platforms import current_platform

    return getattr(current_platform, "dist_backend", "gloo")


class MultiprocExecutor:
    """The engine core's side of the tensor-parallel ranks: the :class:`Worker` methods, run on every rank."""

    def __init__(self, fd_config: FDConfig) -> None:
        self.fd_config = fd_config
        self.layout = node_layout(fd_config)
        self.world_size = self.layout.world_size
        self._closed = False
        self.ctx = zmq.Context(io_threads=1)
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        bind_host = "0.0.0.0" if self.layout.nnodes > 1 else self.layout.master_addr
        self.socket.bind(f"tcp://{bind_host}:{self.layout.master_port + 1}")
        self.procs = start_local_ranks(fd_config, self.layout)
        try:
            self._wait_for_ranks()
        except BaseException:
            self.shutdown()
            raise

    # ---- messaging --------------------------------------------------------------------------
    def _identity(self, rank: int) -> bytes:
        return f"rank{rank}".encode()

    def _recv(self, timeout_s: float | None = None) -> tuple[int, str, Any]:
        """The next (rank, status, value) any rank sends; raises when a local rank died meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.socket.poll(int(_POLL_S * 1000)):
            self._check_ranks_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"The tensor-parallel ranks did not answer within {timeout_s:.0f} s.")
        identity, payload = self.socket.recv_multipart()
        status, value = pickle.loads(payload)
        rank = int(identity.decode()[4:])
        if status == "ERROR":
            raise WorkerDiedError(f"Tensor-parallel rank {rank} failed: {value}")
        return rank, status, value

    def _check_ranks_alive(self) -> None:
        for proc in self.procs:
            if not proc.is_alive():
                raise WorkerDiedError(f"Tensor-parallel worker {proc.name} died unexpectedly (exit code "
                                      f"{proc.exitcode}); see the log above for its error.")

    def _wait_for_ranks(self) -> None:
        pending = set(range(self.world_size))
        while pending:
            rank, status, _ = self._recv(_START_TIMEOUT_S)
            if status == "READY":
                pending.discard(rank)

    def _send_all(self, method: str, args: tuple) -> None:
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank in range(self.world_size):
            self.socket.send_multipart((self._identity(rank), payload))

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Run ``Worker.<method>(*args)`` on every rank; the results in rank order."""
        self._send_all(method, args)
        results: dict[int, Any] = {}
        while len(results) < self.world_size:
            rank, _, value = self._recv()
            results[rank] = value
        return [results[r] for r in range(self.world_size)]

    # ---- the Worker interface ------------------------------------------------------------------
    def load_model(self) -> None:
        self.collective_rpc("load_model")

    def determine_num_available_blocks(self) -> int:
        # Every rank holds its share of every block: the smallest budget decides.
        return min(self.collective_rpc("determine_num_available_blocks"))

    def kv_cache_bytes_per_block(self) -> int:
        return self.collective_rpc("kv_cache_bytes_per_block")[0]

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_blocks)

    def execute_model(self, scheduler_output: Any) -> Any:
        """Broadcast the step to every rank; rank 0's output is the step's (the others do not answer)."""
        self._send_all("execute_model", (scheduler_output,))
        while True:
            rank, _, value = self._recv()
            if rank == 0:
                return value

    def watch_ranks(self, on_death: Callable[[str], None], grace_s: float = 1.0) -> None:
        """Call ``on_death(message)`` from a thread once a local rank exits while the executor is open.

        A step in flight notices it itself (and reports why); an idle engine waits on no rank,
        so without this a dead rank would go unnoticed until the next request.
        """
        def watch() -> None:
            multiprocessing.connection.wait([p.sentinel for p in self.procs])
            time.sleep(grace_s)  # a step in flight reports it first
            if self._closed:
                return
            dead = next(p for p in self.procs if not p.is_alive())
            on_death(f"Tensor-parallel worker {dead.name} died unexpectedly (exit code {dead.exitcode}).")

        threading.Thread(target=watch, name="TPWorkerWatcher", daemon=True).start()

    def shutdown(self) -> None:
        """Stop every local rank (remote ones exit when their socket's peer is gone) and close the socket."""
        if self._closed:
            return
        self._closed = True
        try:  # ranks on other nodes only hear it this way
            self._send_all("shutdown", ())
        except zmq.ZMQError:
            pass
        time.sleep(0.1)
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(1)
        self.socket.close(linger=0)
        self.ctx.term()


# ---- the rank's process -------------------------------------------------------------------------


class _RankZeroSampler:
    """The runner's sampler, with rank 0's sampled tokens broadcast to every rank after each draw.

    Every rank sees the same gathered logits, but unseeded requests draw from each process's
    own generator: the broadcast makes all ranks continue with rank 0's tokens.
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __call__(self, logits: Any, metadata: Any, **kwargs: Any) -> Any:
        import numpy as np
        import paddle

        from fastdeploy.distributed.parallel_state import tensor_model_parallel_broadcast

        result = self.sampler(logits, metadata, **kwargs)
        tokens = paddle.to_tensor(np.ascontiguousarray(result.sampled_token_ids, dtype=np.int64))
        result.sampled_token_ids[...] = tensor_model_parallel_broadcast(tokens, src=0).numpy()
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)


def worker_main(fd_config: FDConfig, init: DistributedInit, executor_address: str, cores: frozenset[int],
                parent_pid: int) -> None:
    """Target of a rank's process: join the group, build the worker, answer the executor until told to stop."""
    bind_process(cores, f"TPWorker-{init.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the engine decides
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{init.rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(executor_address)

    def reply(status: str, value: Any = None) -> None:
        sock.send(pickle.dumps((status, value), protocol=pickle.HIGHEST_PROTOCOL))

    try:
        from fastdeploy.worker.worker import Worker

        init_distributed_environment(init)
        worker = Worker(fd_config, rank=init.rank)
        worker.model_runner.sampler = _RankZeroSampler(worker.model_runner.sampler)
        reply("READY")
        while True:
            while not sock.poll(1000):
                if os.getppid() != parent_pid:
                    os._exit(0)  # the engine (or the headless node's launcher) is gone
            method, args = pickle.loads(sock.recv())
            if method == "shutdown":
                break
            result = getattr(worker, method)(*args)
            if method != "execute_model" or init.rank == 0:
                reply("OK", result)
    except BaseException as e:  # noqa: BLE001 - reported to the engine, then the rank exits non-zero
        logger.error("Tensor-parallel rank %d failed:\n%s", init.rank, traceback.format_exc())
        try:
            reply("ERROR", f"{type(e).__name__}: {e}")
        finally:
            sock.close()
            ctx.term()
        os._exit(1)
    sock.close()
    ctx.term()
    os._exit(0)


def run_headless(fd_config: FDConfig) -> int:
    """A worker node (``--headless``): start this node's ranks, wait for them; the exit code of the first to end."""
    layout = node_layout(fd_config)
    procs = start_local_ranks(fd_config, layout)
    logger.info("Headless node %d of %d: ranks %s joined %s.", layout.node_rank, layout.nnodes,
                list(layout.local_ranks), layout.executor_address)
    try:
        multiprocessing.connection.wait([p.sentinel for p in procs])
    except KeyboardInterrupt:
        pass
    code = next((p.exitcode for p in procs if p.exitcode is not None), 0)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
    return int(code or 0)
