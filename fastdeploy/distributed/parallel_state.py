"""The tensor-parallel group of this process, on paddle.distributed (gloo on CPU, NCCL on GPU).

vLLM's names: :func:`get_tensor_model_parallel_world_size`, :func:`get_tensor_model_parallel_rank`,
:func:`tensor_model_parallel_all_reduce`, :func:`tensor_model_parallel_all_gather`. A process
that never called :func:`init_distributed_environment` is a group of one: every helper is then
the identity, so the layers are built and run exactly as without tensor parallelism.

A worker joins its group the way Paddle's launcher starts processes: the ``PADDLE_*``
variables (backend, trainer id and count, the endpoints; endpoint 0 hosts the rendezvous
store) are set in the process before ``paddle.distributed.init_parallel_env()`` reads them.
Each engine (each data-parallel replica) has a world of its own, so its collectives never
meet another engine's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import paddle

from fastdeploy.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class DistributedInit:
    """Where a rank finds its group: ``master_addr:master_port`` hosts the rendezvous store (rank 0's endpoint)."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "gloo"

    def paddle_environment(self) -> dict[str, str]:
        """The variables ``paddle.distributed.init_parallel_env`` reads, for this rank.

        Only endpoint 0 is contacted (it serves the store); the others name the ranks. They
        are distinct fake ports on the master's address, which Paddle only checks for form.
        """
        endpoints = [f"{self.master_addr}:{self.master_port + i}" for i in range(self.world_size)]
        return {
            "PADDLE_DISTRI_BACKEND": self.backend,
            "PADDLE_TRAINER_ID": str(self.rank),
            "PADDLE_TRAINERS_NUM": str(self.world_size),
            "PADDLE_CURRENT_ENDPOINT": endpoints[self.rank],
            "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
            "PADDLE_RANK_IN_NODE": str(self.rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


class _TPState:
    world_size: int = 1
    rank: int = 0
    group: object | None = None


_TP = _TPState()


def init_distributed_environment(init: DistributedInit) -> None:
    """Join the group described by ``init`` (one call per process, before the model is built)."""
    if _TP.world_size != 1:
        raise RuntimeError("The tensor-parallel group is already initialized in this process.")
    if init.world_size == 1:
        return
    import paddle.distributed as dist

    # Written for Paddle, not read by FastDeploy (which reads its own variables through envs.py).
    for name, value in init.paddle_environment().items():
        os.environ[name] = value
    dist.init_parallel_env()
    if dist.get_world_size() != init.world_size or dist.get_rank() != init.rank:
        raise RuntimeError(f"paddle.distributed joined as rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"expected rank {init.rank} of {init.world_size}.")
    _TP.world_size, _TP.rank, _TP.group = init.world_size, init.rank, None  # None: the whole world
    logger.info("Tensor-parallel rank %d of %d joined (%s, store at %s:%d).", init.rank, init.world_size,
                init.backend, init.master_addr, init.master_port)


def get_tensor_model_parallel_world_size() -> int:
    """Ranks that split each layer (1 without tensor parallelism)."""
    return _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in its tensor-parallel group."""
    return _TP.rank


def tensor_model_parallel_all_reduce(x: paddle.Tensor) -> paddle.Tensor:
    """Sum ``x`` over the ranks, in place; returned for chaining."""
    if _TP.world_size == 1:
        return x
    import paddle.distributed as dist

    dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: paddle.Tensor, axis: int = -1) -> paddle.Tensor:
    """Every rank's ``x`` concatenated along ``axis``, in rank order."""
    if _TP.world_size == 1:
        return x
    import paddle.distributed as dist

    parts: list[paddle.Tensor] = []
    dist.all_gather(parts, x.contiguous() if not x.is_contiguous() else x, group=_TP.group)
    return paddle.concat(parts, axis=axis)


def tensor_model_parallel_broadcast(x: paddle.Tensor, src: int = 0) -> paddle.Tensor:
    """Rank ``src``'s ``x`` on every rank, in place."""
    if _TP.world_size == 1:
        return x
    import paddle.distributed as dist

    dist.broadcast(x, src=src, group=_TP.group)
    return x


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator / denominator`` when it divides; a ValueError naming ``what`` and -tp otherwise."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by --tensor-parallel-size ({denominator}).")
    return numerator // denominator


def kv_heads_per_rank(total_kv_heads: int, tp_size: int) -> int:
    """KV heads each rank holds: a share when they split, one (replicated) when there are fewer than ranks."""
    if total_kv_heads >= tp_size:
        return divide(total_kv_heads, tp_size, "num_key_value_heads")
    if tp_size % total_kv_heads:
        raise ValueError(f"--tensor-parallel-size ({tp_size}) must be a multiple of num_key_value_heads "
                         f"({total_kv_heads}) when it is larger, so each KV head is replicated on whole ranks.")
    return 1


def check_model_splits(hf_config: object, tp_size: int) -> None:
    """Refuse at start-up, naming the dimension, a model whose layers cannot split over ``tp_size`` ranks."""
    if tp_size == 1:
        return
    heads = hf_config.num_attention_heads
    divide(heads, tp_size, "num_attention_heads")
    kv_heads_per_rank(getattr(hf_config, "num_key_value_heads", None) or heads, tp_size)
    intermediate = getattr(hf_config, "intermediate_size", None)
    if intermediate:
        divide(intermediate, tp_size, "intermediate_size")
