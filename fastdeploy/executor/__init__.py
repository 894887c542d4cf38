"""Executors: how the engine core reaches its model (vLLM's ``vllm/v1/executor``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig


def create_executor(fd_config: FDConfig) -> Any:
    """The in-process :class:`~fastdeploy.worker.worker.Worker` at one rank; a :class:`MultiprocExecutor` for -tp > 1.

    Both have the same methods (load_model, determine_num_available_blocks,
    kv_cache_bytes_per_block, initialize_cache, execute_model, shutdown).
    """
    if fd_config.parallel_config.tensor_parallel_size == 1:
        from fastdeploy.worker.worker import Worker

        return Worker(fd_config)
    from fastdeploy.executor.multiproc_executor import MultiprocExecutor

    return MultiprocExecutor(fd_config)
