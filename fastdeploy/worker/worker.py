"""A worker: one per device (per tensor-parallel rank); sets the device up and runs its model runner."""

from __future__ import annotations

from fastdeploy.config import FDConfig
from fastdeploy.engine.sched.output import SchedulerOutput
from fastdeploy.logger import init_logger
from fastdeploy.platforms import current_platform
from fastdeploy.worker.model_runner import ModelRunner
from fastdeploy.worker.model_runner_output import ModelRunnerOutput

logger = init_logger(__name__)


class Worker:
    """Device set-up, model loading and KV-cache sizing for one rank."""

    def __init__(self, fd_config: FDConfig, rank: int = 0) -> None:
        self.fd_config = fd_config
        self.rank = rank
        current_platform.set_device()
        self.model_runner = ModelRunner(fd_config)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_available_blocks(self) -> int:
        """How many KV blocks fit in the platform's KV-cache budget."""
        budget = current_platform.kv_cache_bytes(self.fd_config)
        per_block = self.model_runner.kv_cache_bytes_per_block()
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"The KV cache budget ({budget} bytes) holds no block of {per_block} bytes; "
                "raise --kv-cache-memory-bytes or FD_CPU_KVCACHE_SPACE."
            )
        return int(num_blocks)

    def kv_cache_bytes_per_block(self) -> int:
        return self.model_runner.kv_cache_bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Nothing to release in-process (the executor's ranks stop here)."""
