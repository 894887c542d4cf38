"""EngineArgs: every engine flag, with vLLM's names and defaults plus FastDeploy's own spellings."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from fastdeploy.config import (
    CacheConfig,
    FDConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from fastdeploy.engine.cli_args import KV_CACHE_DTYPES, add_engine_cli_args
from fastdeploy.logger import init_logger
from fastdeploy.utils.argparse_utils import parse_json, parse_size

# parse_size / parse_json live with the other flag parsers; re-exported here, where they used to be.
__all__ = ["AsyncEngineArgs", "EngineArgs", "parse_json", "parse_size", "warn_ignored_flags"]

logger = init_logger(__name__)

# Engine flags accepted so vLLM and FastDeploy scripts run unchanged, that change nothing in
# this engine on any platform; setting one logs why (see warn_ignored_flags). The platform
# adds its own (Platform.ignored_flags), e.g. --gpu-memory-utilization on CPU.
_NO_EFFECT_FLAGS: dict[str, str] = {
    "swap_space": "preempted requests are recomputed, their KV blocks are never swapped out (as vLLM V1)",
    "kv_cache_ratio": "prefill and decode take KV blocks from one shared pool on demand (vLLM's scheduling); "
                      "no share of the blocks is reserved for prefill",
    "cache_queue_port": "the KV cache lives in the engine core process, so there is no cache-transfer queue; "
                        "PD transfers use --pd-comm-port / --kv-transfer-config",
    "enable_logprob": "logprobs are always available (requests ask with logprobs / top_logprobs)",
    "revision": "models are read from local folders (or the embedded default model), so there is no "
                "revision to choose",
}


def warn_ignored_flags(values: Mapping[str, Any], ignored: Mapping[str, tuple[Any, str]]) -> list[str]:
    """Log one warning for each flag in ``ignored`` that is set to a value other than its default.

    The one place that tells a user a flag they set changes nothing here (engine flags from
    EngineArgs, the server's own from validate_parsed_serve_args).

    Args:
        values: flag values by dest name (EngineArgs fields or the parsed namespace).
        ignored: dest name -> (default, reason the flag has no effect).

    Returns:
        The dest names warned about, in ``ignored``'s order.
    """
    warned = []
    for name, (default, reason) in ignored.items():
        if name in values and values[name] != default:
            logger.warning("--%s=%r has no effect: %s.", name.replace("_", "-"), values[name], reason)
            warned.append(name)
    return warned


# Native model classes whose every layer splits over tensor-parallel ranks (the dense Llama family);
# the MoE experts and DeepSeek's latent attention do not shard yet.
_TENSOR_PARALLEL_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM")


def _check_tensor_parallel_architecture(model_config: ModelConfig) -> None:
    """Refuse by name a native architecture whose layers are not built to split (-tp > 1)."""
    from fastdeploy.model_executor.models.registry import ModelRegistry

    cls = ModelRegistry.resolve(model_config.architectures, "fastdeploy")
    if cls.__name__ not in _TENSOR_PARALLEL_MODELS:
        raise ValueError(f"--tensor-parallel-size > 1 is not supported for {cls.__name__} by this FastDeploy build "
                         f"yet (its MoE experts / attention do not shard); tensor parallel runs "
                         f"{', '.join(_TENSOR_PARALLEL_MODELS)}.")


@dataclass
class EngineArgs:
    """Arguments of the engine, as accepted by ``LLM(...)`` and ``fastdeploy serve``."""

    model: str | None = None
    served_model_name: list[str] | str | None = None
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    quantization: str | None = None
    load_format: str = "auto"
    max_logprobs: int = 20
    generation_config: str = "auto"
    enforce_eager: bool = False
    model_impl: str = "auto"
    # Multimodal inputs
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    # Cache
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4
    enable_prefix_caching: bool | None = None
    kv_cache_ratio: float = 0.75
    kv_cache_dtype: str = "auto"
    # Scheduler
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    scheduling_policy: str = "fcfs"
    scheduler_name: str = "local"
    # Parallelism
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Multi-node tensor parallelism (vLLM's names).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    # Features that live in their own configs.
    speculative_config: dict[str, Any] | None = None
    kv_transfer_config: dict[str, Any] | None = None
    structured_outputs_config: dict[str, Any] | StructuredOutputsConfig | None = None
    graph_optimization_config: dict[str, Any] | None = None
    splitwise_role: str = "mixed"
    disable_log_stats: bool = False
    show_hidden_metrics_for_version: str | None = None
    # vLLM's text watermarking (not built: refused by name).
    watermark_config: dict[str, Any] | None = None
    enable_logprob: bool = False
    # FastDeploy's own deployment flags: engine ports, PD disaggregation (KVTransferConfig),
    # the router to register with and the global scheduler's Redis.
    engine_worker_queue_port: int | None = None
    cache_queue_port: int | None = None
    cache_transfer_protocol: str | None = None
    pd_comm_port: list[int] | None = None
    router: str | None = None
    scheduler_host: str | None = None
    scheduler_port: int | None = None
    scheduler_topic: str | None = None
    scheduler_db: int | None = None
    scheduler_password: str | None = None
    scheduler_ttl: int | None = None
    # vLLM's legacy spelling of structured_outputs_config["backend"].
    guided_decoding_backend: str | None = None

    def create_engine_config(self) -> FDConfig:
        """Validate the arguments and build the FDConfig; unbuilt features fail here by name."""
        self._reject_unbuilt()
        self._warn_ignored_flags()
        # Checked before the model is loaded so a bad backend fails fast.
        structured_outputs_config = self._structured_outputs_config()
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            tokenizer_mode=self.tokenizer_mode,
            skip_tokenizer_init=self.skip_tokenizer_init,
            trust_remote_code=self.trust_remote_code,
            dtype=self.dtype,
            seed=self.seed,
            revision=self.revision,
            max_model_len=None if self.max_model_len is None else parse_size(self.max_model_len),
            max_logprobs=self.max_logprobs,
            generation_config=self.generation_config,
            served_model_name=[self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name,
            model_impl=self.model_impl,
            quantization=self.quantization,
            enforce_eager=self.enforce_eager,
            limit_mm_per_prompt=parse_json(self.limit_mm_per_prompt),
            allowed_local_media_path=self.allowed_local_media_path or "",
            allowed_media_domains=self.allowed_media_domains,
        )
        from fastdeploy.model_executor.models.sliding_window import check_sliding_window

        check_sliding_window(model_config)
        cache_config = CacheConfig(
            block_size=self.block_size or 16,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            swap_space=self.swap_space,
            enable_prefix_caching=True if self.enable_prefix_caching is None else self.enable_prefix_caching,
            kv_cache_ratio=self.kv_cache_ratio,
            cache_dtype=self.kv_cache_dtype,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs or 256,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=True if self.enable_chunked_prefill is None else self.enable_chunked_prefill,
            policy=self.scheduling_policy,
            scheduler_name=self.scheduler_name,
            scheduler_host=self.scheduler_host,
            scheduler_port=self.scheduler_port,
            scheduler_topic=self.scheduler_topic,
            scheduler_db=self.scheduler_db,
            scheduler_password=self.scheduler_password,
            scheduler_ttl=self.scheduler_ttl,
        )
        return FDConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=self._parallel_config(model_config),
            load_config=LoadConfig(load_format=self.load_format),
            speculative_config=self.speculative_config,
            kv_transfer_config=KVTransferConfig.from_flags(self.splitwise_role, self.kv_transfer_config,
                                                           self.pd_comm_port, self.cache_transfer_protocol,
                                                           self.router),
            structured_outputs_config=structured_outputs_config,
            observability_config=ObservabilityConfig(self.show_hidden_metrics_for_version),
        )

    def _parallel_config(self, model_config: ModelConfig) -> ParallelConfig:
        """-tp / -dp and the multi-node flags, checked against the model and the cores before anything starts."""
        from fastdeploy.distributed.parallel_state import check_model_splits
        from fastdeploy.platforms.cpu_binding import plan_rank_cores

        config = ParallelConfig(self.tensor_parallel_size, self.data_parallel_size, self.pipeline_parallel_size,
                                nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr,
                                master_port=self.master_port)
        tp = config.tensor_parallel_size
        if tp > 1:
            check_model_splits(model_config.hf_config, tp)
            if self.splitwise_role != "mixed" or self.kv_transfer_config or self.pd_comm_port:
                raise ValueError("--tensor-parallel-size > 1 with prefill/decode disaggregation is not supported by "
                                 "this FastDeploy build yet: the KV connector reads one rank's cache "
                                 "(--splitwise-role / --kv-transfer-config).")
            from fastdeploy.model_executor.models.registry import serves_natively

            if not serves_natively(model_config):
                raise ValueError("--tensor-parallel-size > 1 is not supported by the PaddleFormers backend "
                                 "(--model-impl paddleformers): its layers are PaddleFormers' own, which hold "
                                 "every weight whole; use a natively implemented architecture.")
            _check_tensor_parallel_architecture(model_config)
            if self.speculative_config is not None:
                # The ranks verify drafts with their own samplers: unseeded draws could accept different
                # counts per rank, and only one sampled token per request is broadcast from rank 0.
                raise ValueError("--tensor-parallel-size > 1 with --speculative-config is not supported by this "
                                 "FastDeploy build yet: run speculative decoding at one rank.")
        if config.data_parallel_size > 1 and (self.splitwise_role != "mixed" or self.kv_transfer_config
                                              or self.pd_comm_port or self.scheduler_name == "global"):
            raise ValueError("--data-parallel-size > 1 with prefill/decode disaggregation or the global scheduler "
                             "is not supported by this FastDeploy build yet: run one instance per replica behind "
                             "the router instead (--data-parallel-size).")
        if self.nnodes > 1 and tp % self.nnodes:
            raise ValueError(f"--tensor-parallel-size ({tp}) must be a multiple of --nnodes ({self.nnodes}).")
        # Every rank on this node computes on cores of its own (or shares them on purpose).
        plan_rank_cores(tp // max(self.nnodes, 1) * config.data_parallel_size)
        return config

    def _structured_outputs_config(self) -> StructuredOutputsConfig:
        """--structured-outputs-config with the legacy --guided-decoding-backend folded in as its backend."""
        value = self.structured_outputs_config
        values = dataclasses.asdict(value) if isinstance(value, StructuredOutputsConfig) else dict(value or {})
        if self.guided_decoding_backend is not None:
            values.setdefault("backend", self.guided_decoding_backend)
        return StructuredOutputsConfig.from_value(values)

    def _warn_ignored_flags(self) -> list[str]:
        """Warn once for each flag set here that has no effect in this engine or on this platform."""
        from fastdeploy.platforms import current_platform

        values = {f.name: getattr(self, f.name) for f in fields(self)}
        defaults = {f.name: f.default for f in fields(self)}
        reasons = {**_NO_EFFECT_FLAGS, **current_platform.ignored_flags()}
        return warn_ignored_flags(values, {name: (defaults[name], reason) for name, reason in reasons.items()})

    def _reject_unbuilt(self) -> None:
        """Refuse, by flag name, values that ask for a feature this build lacks."""
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"Invalid --kv-cache-dtype {self.kv_cache_dtype!r}; expected one of "
                             f"{', '.join(KV_CACHE_DTYPES)}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"Invalid --scheduling-policy {self.scheduling_policy!r}; expected fcfs or priority.")
        unbuilt = {
            "pipeline_parallel_size": self.pipeline_parallel_size != 1,
            # PD goes through the router (--splitwise-role); FastDeploy's splitwise scheduler is not built.
            "scheduler_name": self.scheduler_name == "splitwise",
            # The scheduler serves requests first come, first served; the request's priority is not read.
            "scheduling_policy": self.scheduling_policy == "priority",
            # No kernel reads or writes an fp8 KV cache ("bfloat16" is checked against the model's dtype).
            "kv_cache_dtype": self.kv_cache_dtype.startswith("fp8"),
            # vLLM's Gumbel-max text watermarking: the sampler has no keyed watermark here.
            "watermark_config": self.watermark_config is not None,
        }
        for name, used in unbuilt.items():
            if used:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not supported by this FastDeploy build yet "
                    f"(--{name.replace('_', '-')})."
                )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keyword arguments; an unknown one is a TypeError naming it (as vLLM)."""
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise TypeError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}")
        for key in ("speculative_config", "kv_transfer_config", "structured_outputs_config", "graph_optimization_config",
                    "watermark_config"):
            if key in kwargs and not isinstance(kwargs[key], StructuredOutputsConfig):
                kwargs[key] = parse_json(kwargs[key])
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add every engine flag (vLLM's names and defaults, FastDeploy's aliases) to ``parser``."""
        return add_engine_cli_args(parser)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """EngineArgs from parsed flags (flags that are not engine fields are ignored)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


@dataclass
class AsyncEngineArgs(EngineArgs):
    """Arguments of the asynchronous engine behind the API server (vLLM's ``AsyncEngineArgs``)."""

    enable_log_requests: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Engine flags plus the request-logging switches of the server."""
        EngineArgs.add_cli_args(parser)
        parser.add_argument("--enable-log-requests", action="store_true", help="Log every request's inputs.")
        parser.add_argument("--disable-log-requests", action="store_true",
                            help="Deprecated (requests are not logged unless --enable-log-requests).")
        return parser
