"""EngineCore: the schedule -> execute -> update loop around one model."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastdeploy.config import FDConfig
from fastdeploy.engine.request import EngineCoreOutputs, EngineCoreRequest, Request, RequestStatus
from fastdeploy.engine.sched.scheduler import Scheduler
from fastdeploy.executor import create_executor
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.guided_decoding.manager import StructuredOutputManager
from fastdeploy.utils.gc_utils import freeze_gc_heap

if TYPE_CHECKING:
    from fastdeploy.distributed.kv_transfer.pd_engine import PDKVTransfer
    from fastdeploy.platforms.cpu_binding import WideSteps

logger = init_logger(__name__)

# Longest sleep of an idle step whose only requests wait for their grammars.
_GRAMMAR_WAIT_S = 0.05
# Longest sleep of an idle step waiting for a KV cache, and between checks of handed-over blocks.
_KV_WAIT_S = 0.05
_KV_RELEASE_POLL_S = 0.02


class EngineCore:
    """Owns the scheduler and the worker; ``step()`` runs one batch.

    Args:
        fd_config: the engine configuration.
        tokenizer: the model's tokenizer when the caller has it loaded already (structured
            outputs need one; otherwise it is loaded when the first constrained request comes).
    """

    def __init__(self, fd_config: FDConfig, tokenizer: Any = None) -> None:
        self.fd_config = fd_config
        # Set by the engine process when long steps may use the API process's cores too.
        self.wide_steps: WideSteps | None = None
        start = time.perf_counter()
        # The model's worker in this process, or the executor of the tensor-parallel ranks.
        self.worker = create_executor(fd_config)
        self.worker.load_model()
        num_blocks = self.worker.determine_num_available_blocks()
        cache = fd_config.cache_config
        cache.num_blocks = num_blocks
        self.worker.initialize_cache(num_blocks)
        mc = fd_config.model_config
        max_per_req = -(-mc.max_model_len // cache.block_size)
        if num_blocks < max_per_req:
            per_block = self.worker.kv_cache_bytes_per_block()
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({mc.max_model_len}), "
                f"{max_per_req * per_block / (1 << 30):.2f} GiB KV cache is needed, which is larger than the "
                f"available KV cache memory ({num_blocks * per_block / (1 << 30):.2f} GiB). Based on the available "
                f"memory, the estimated maximum model length is {num_blocks * cache.block_size}. Try increasing "
                "--kv-cache-memory-bytes (or FD_CPU_KVCACHE_SPACE) or decreasing `max_model_len`."
            )
        self.structured_output_manager = StructuredOutputManager(fd_config, tokenizer)
        self.kv_transfer = self._start_kv_transfer()
        self.scheduler = Scheduler(
            fd_config.scheduler_config, cache, mc.max_model_len, structured_output_manager=self.structured_output_manager,
            kv_transfer=self.kv_transfer, speculative_config=fd_config.speculative_config,
        )
        freeze_gc_heap()
        logger.info(
            "Engine ready in %.1f s: %d KV blocks of %d tokens (%.2f GiB), max_model_len=%d, max_num_seqs=%d, "
            "max_num_batched_tokens=%d.",
            time.perf_counter() - start,
            num_blocks,
            cache.block_size,
            num_blocks * self.worker.kv_cache_bytes_per_block() / (1 << 30),
            mc.max_model_len,
            fd_config.scheduler_config.max_num_seqs,
            fd_config.scheduler_config.max_num_batched_tokens,
        )

    def _start_kv_transfer(self) -> PDKVTransfer | None:
        """The KV connector of a disaggregated instance, bound before the engine reports ready."""
        config = self.fd_config.kv_transfer_config
        if not config.enabled:
            return None
        from fastdeploy.distributed.kv_transfer.metrics import KVTransferMetrics
        from fastdeploy.distributed.kv_transfer.pd_engine import PDKVTransfer
        from fastdeploy.distributed.kv_transfer.utils import numpy_kv_caches

        pd = PDKVTransfer(numpy_kv_caches(self.worker.model_runner.kv_caches), config.host, config.port,
                          advertise_host=config.advertise_host, protocol=config.protocol, timeout_s=config.timeout_s,
                          metrics=KVTransferMetrics(keep_events=True))
        config.port = pd.address.port
        logger.info("KV transfer: %s instance, connector on %s:%d (protocol %s).", config.role, pd.address.host,
                    pd.address.port, config.protocol)
        return pd

    def switch_role(self, role: str) -> str:
        """Change the disaggregation role (the router decides what each role gets); returns the old one."""
        config = self.fd_config.kv_transfer_config
        if role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"Invalid role {role!r}; expected mixed, prefill or decode.")
        if role != "mixed" and self.kv_transfer is None:
            raise ValueError("This instance runs without a KV connector, so it cannot become a prefill or decode "
                             "instance; start it with --splitwise-role, --pd-comm-port or --router.")
        old, config.role = config.role, role
        logger.info("Role switched from %s to %s.", old, role)
        return old

    def shutdown(self) -> None:
        if self.kv_transfer is not None:
            self.kv_transfer.close()
        self.worker.shutdown()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(request, self.fd_config.model_config.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        """Schedule one batch, run it, and return what each request produced."""
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time())
        scheduler_output = self.scheduler.schedule()
        if self.wide_steps is not None:
            self.wide_steps.for_step(scheduler_output.total_num_scheduled_tokens)
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing runnable: sleep until a grammar compiles rather than spin on the loop.
            waiting = self.scheduler.requests_waiting_for_grammar()
            if waiting:
                self.structured_output_manager.wait_for_any(waiting, timeout=_GRAMMAR_WAIT_S)
            elif self.kv_transfer is not None and self.scheduler.has_pending_kv_transfers():
                # Wakes as soon as a KV cache arrives; held prefill blocks are only checked now and then.
                self.kv_transfer.wait(_KV_WAIT_S if self.scheduler.waiting_for_kv else _KV_RELEASE_POLL_S)
        runner_output = self.worker.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()
