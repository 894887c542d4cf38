"""Engine configuration: one dataclass per concern, gathered into :class:`FDConfig`."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from fastdeploy import envs
from fastdeploy.logger import init_logger

logger = init_logger(__name__)

_STR_DTYPE = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


@dataclass
class ModelConfig:
    """What model to run and how to read it.

    ``model`` is what the user asked for (a path or a known name); ``model_path``
    is the resolved local folder and ``gguf_file`` the GGUF file name inside it
    when the checkpoint is a single GGUF file.
    """

    model: str
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    # No tokenizer: prompts must be token ids and outputs carry no text (vLLM's option).
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    dtype: str = "auto"
    seed: int | None = 0
    revision: str | None = None
    max_model_len: int | None = None
    max_logprobs: int = 20
    generation_config: str = "auto"
    served_model_name: list[str] | None = None
    model_impl: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False
    # Multimodal inputs (vLLM's MultiModalConfig / ModelConfig fields): most items of each
    # modality per prompt, the folder file:// URLs may read, the hosts http(s) URLs may name.
    limit_mm_per_prompt: dict[str, int] | None = None
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    # Filled in by __post_init__.
    model_path: str = ""
    gguf_file: str | None = None
    tokenizer_path: str = ""
    hf_config: Any = None
    hf_text_config: Any = None

    def __post_init__(self) -> None:
        from fastdeploy.transformers_utils.config import get_hf_config
        from fastdeploy.transformers_utils.model_resolver import resolve_model

        self.model_path, self.gguf_file = resolve_model(self.model)
        if self.tokenizer is None:
            self.tokenizer_path = self.model_path
        else:
            self.tokenizer_path = resolve_model(self.tokenizer)[0]
        if self.dtype not in _STR_DTYPE:
            raise ValueError(f"Unknown dtype: {self.dtype!r}. Choose one of {sorted(_STR_DTYPE)}.")
        self.dtype = _STR_DTYPE[self.dtype]
        if self.quantization:  # method names are case-insensitive, as in vLLM
            self.quantization = self.quantization.lower()
        if self.model_impl not in ("auto", "fastdeploy", "paddleformers"):
            raise ValueError(
                f"model_impl must be one of 'auto', 'fastdeploy', 'paddleformers', got {self.model_impl!r}."
            )
        self.hf_config = get_hf_config(self.model_path, self.gguf_file, self.trust_remote_code)
        # A vision-language config nests its language model's (text_config); text models are their own.
        self.hf_text_config = self.hf_config.get_text_config()
        derived = self.hf_text_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = derived
        elif self.max_model_len > derived:
            raise ValueError(
                f"User-specified max_model_len ({self.max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={derived} in model's config.json)."
            )
        if self.served_model_name is None:
            self.served_model_name = [self.model]

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_text_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_text_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    def get_num_kv_heads(self, parallel_config: ParallelConfig) -> int:
        """KV heads one tensor-parallel rank holds (vLLM's name): a share, or one replicated head."""
        from fastdeploy.distributed.parallel_state import kv_heads_per_rank

        return kv_heads_per_rank(self.num_kv_heads, parallel_config.tensor_parallel_size)

    @property
    def head_dim(self) -> int:
        cfg = self.hf_text_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def get_generation_config(self) -> dict[str, Any]:
        """Sampling defaults the model ships in generation_config.json (vLLM's --generation-config)."""
        if self.generation_config == "vllm":
            return {}
        folder = self.model_path if self.generation_config == "auto" else self.generation_config
        path = os.path.join(folder, "generation_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)


@dataclass
class CacheConfig:
    """Paged KV cache: block size, size of the pool, prefix caching."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4
    enable_prefix_caching: bool = True
    kv_cache_ratio: float = 0.75
    # "auto": the model's compute dtype, the only one the attention kernels read (FDConfig checks it).
    cache_dtype: str = "auto"
    # Decided at engine start from the memory budget.
    num_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}.")

    def kv_cache_bytes(self) -> int:
        """Memory granted to the KV cache: --kv-cache-memory-bytes, else FD/VLLM_CPU_KVCACHE_SPACE GiB."""
        if self.kv_cache_memory_bytes is not None:
            return int(self.kv_cache_memory_bytes)
        return int(envs.cpu_kvcache_space_gib() * (1 << 30))


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    max_model_len: int = 0
    scheduler_name: str = "local"
    policy: str = "fcfs"
    # --scheduler-name global: the Redis the instances share and the topic that groups them
    # (None: GlobalSchedulerConfig's defaults).
    scheduler_host: str | None = None
    scheduler_port: int | None = None
    scheduler_topic: str | None = None
    scheduler_db: int | None = None
    scheduler_password: str | None = None
    scheduler_ttl: int | None = None

    def finalize(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({max_model_len}). This effectively limits the maximum sequence length to "
                "max_num_batched_tokens and makes vLLM reject longer sequences. Please increase "
                "max_num_batched_tokens or decrease max_model_len."
            )
        if self.max_num_batched_tokens < self.max_num_seqs and self.max_num_seqs > 1:
            # Every running sequence needs at least one token of budget per step.
            self.max_num_seqs = min(self.max_num_seqs, self.max_num_batched_tokens)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Multi-node tensor parallelism (vLLM's flags): the head node (node_rank 0) hosts the group's store at
    # master_addr:master_port (0: a free port, one node only) and the executor's socket on the next port.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")


@dataclass
class LoadConfig:
    load_format: str = "auto"
    download_dir: str | None = None

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy", "pt"):
            raise ValueError(
                f"load_format must be one of 'auto', 'safetensors', 'gguf', 'dummy', got {self.load_format!r}."
            )


# Backends vLLM accepts; only these are built into this FastDeploy.
_STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
_BUILT_STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")


@dataclass
class StructuredOutputsConfig:
    """Engine-wide structured outputs settings (vLLM's ``--structured-outputs-config``).

    ``backend`` "auto" resolves to xgrammar, the only backend built here.
    ``reasoning_parser`` names a reasoning parser whose end-of-thinking marker
    turns the grammar on, so a thinking model reasons freely and only its answer
    is constrained (unless ``enable_in_reasoning``).
    ``disable_fallback`` is always in effect: with one backend there is nothing to fall back
    to, so a constraint xgrammar cannot enforce is refused (400), never handed to another.
    ``disable_additional_properties`` adds ``additionalProperties: false`` to every JSON
    schema object that does not set it; ``disable_any_whitespace`` makes JSON compact.
    """

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"Unknown structured outputs backend {self.backend!r}; expected one of "
                f"{', '.join(_STRUCTURED_OUTPUTS_BACKENDS)}."
            )
        if self.backend not in _BUILT_STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"Structured outputs backend {self.backend!r} is not built into FastDeploy; "
                "use 'xgrammar' (or 'auto')."
            )
        if self.reasoning_parser:
            from fastdeploy.reasoning import ReasoningParserManager

            try:
                ReasoningParserManager.get_reasoning_parser(self.reasoning_parser)
            except KeyError as e:
                raise ValueError(str(e).strip("'\"")) from None

    @classmethod
    def from_value(cls, value: StructuredOutputsConfig | dict[str, Any] | None) -> StructuredOutputsConfig:
        """The config from a dict (``--structured-outputs-config '{...}'``), or the defaults."""
        if isinstance(value, cls):
            return value
        value = dict(value or {})
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"Unknown structured outputs config key(s): {', '.join(sorted(unknown))}.")
        return cls(**value)

    @property
    def resolved_backend(self) -> str:
        """The backend actually used ("auto" -> "xgrammar")."""
        return "xgrammar" if self.backend == "auto" else self.backend


# vLLM's kv_role for each FastDeploy splitwise role.
_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "mixed"}


@dataclass
class KVTransferConfig:
    """Prefill/decode disaggregation: this instance's role and its KV connector.

    Built from FastDeploy's flags (``--splitwise-role``, ``--pd-comm-port``,
    ``--cache-transfer-protocol``) or vLLM's ``--kv-transfer-config`` (``kv_role``,
    ``kv_port``, ``kv_ip``). Any instance whose connector is up serves both halves of a
    split request; the role tells the router which half to send it.
    """

    role: str = "mixed"
    # Whether the engine opens a KV connector (a role other than mixed, or any PD flag).
    enabled: bool = False
    port: int = 0  # 0: any free port (reported back once bound)
    host: str = "0.0.0.0"
    advertise_host: str | None = None
    protocol: str = "auto"  # auto (shared memory on this host, TCP otherwise), tcp or shm
    timeout_s: float = 120.0
    kv_connector: str | None = None

    @classmethod
    def from_flags(cls, splitwise_role: str = "mixed", kv_transfer_config: dict[str, Any] | None = None,
                   pd_comm_port: list[int] | int | None = None, cache_transfer_protocol: str | None = None,
                   router: str | None = None) -> KVTransferConfig:
        """Resolve the PD flags; conflicting or unknown values are a ValueError naming the flag."""
        kv = dict(kv_transfer_config or {})
        role = splitwise_role or "mixed"
        if role not in ("mixed", "prefill", "decode"):
            raise ValueError(f"Invalid --splitwise-role {role!r}; expected mixed, prefill or decode.")
        kv_role = kv.get("kv_role")
        if kv_role is not None:
            if kv_role not in _KV_ROLES:
                raise ValueError(f"Invalid kv_role {kv_role!r} in --kv-transfer-config; expected one of "
                                 f"{', '.join(_KV_ROLES)}.")
            if role != "mixed" and _KV_ROLES[kv_role] != role:
                raise ValueError(f"--splitwise-role {role} contradicts kv_role {kv_role} in --kv-transfer-config.")
            role = _KV_ROLES[kv_role]
        if isinstance(pd_comm_port, list | tuple):
            pd_comm_port = pd_comm_port[0] if pd_comm_port else None
        port = int(pd_comm_port if pd_comm_port is not None else kv.get("kv_port") or 0)
        protocol = _connector_protocol(cache_transfer_protocol or kv.get("kv_connector_extra_config", {}).get(
            "transfer_protocol"))
        enabled = role != "mixed" or bool(kv) or pd_comm_port is not None or bool(router)
        return cls(role=role, enabled=enabled, port=port, advertise_host=kv.get("kv_ip"), protocol=protocol,
                   timeout_s=envs.kv_transfer_timeout_s(), kv_connector=kv.get("kv_connector"))


def _connector_protocol(value: str | None) -> str:
    """``--cache-transfer-protocol`` (FastDeploy's ipc/rdma, or shm/tcp) as the connector's protocol."""
    if not value:
        return "auto"
    names = {{"ipc": "shm", "rdma": "tcp"}.get(v.strip().lower(), v.strip().lower()) for v in value.split(",")}
    unknown = names - {"shm", "tcp"}
    if unknown:
        raise ValueError(f"Invalid --cache-transfer-protocol {value!r}; expected ipc, rdma, shm or tcp "
                         "(comma-separated).")
    return names.pop() if len(names) == 1 else "auto"


@dataclass
class ObservabilityConfig:
    """What the engine reports about itself (vLLM's ObservabilityConfig).

    ``show_hidden_metrics_for_version``: vLLM's escape hatch for Prometheus metrics that were
    deprecated and then hidden in a release; given that release's previous minor version
    ("0.32" for 0.33, the vLLM release FastDeploy follows) the hidden metrics are exported
    again. Any other version shows none, as in vLLM.
    """

    show_hidden_metrics_for_version: str | None = None

    def __post_init__(self) -> None:
        version = self.show_hidden_metrics_for_version
        if version is not None and not re.fullmatch(r"\d+\.\d+", version):
            raise ValueError(f"--show-hidden-metrics-for-version must be a MAJOR.MINOR version such as "
                             f"{previous_minor_version()!r}, got {version!r}.")

    @property
    def show_hidden_metrics(self) -> bool:
        return self.show_hidden_metrics_for_version == previous_minor_version()


def previous_minor_version() -> str:
    """The minor version before the vLLM release whose API and metrics FastDeploy follows."""
    from fastdeploy.version import VLLM_COMPAT_VERSION

    major, minor = (int(part) for part in VLLM_COMPAT_VERSION.split(".")[:2])
    return f"{major}.{minor - 1}"


@dataclass
class FDConfig:
    """Everything the engine needs, resolved and validated once."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    # A dict (the --speculative-config JSON) is resolved into a SpeculativeConfig.
    speculative_config: Any = None
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    # A dict (from the command line) is turned into a StructuredOutputsConfig.
    structured_outputs_config: StructuredOutputsConfig | dict[str, Any] | None = None
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def __post_init__(self) -> None:
        from fastdeploy.platforms import current_platform

        self.structured_outputs_config = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        self._resolve_speculative_config()

        self.scheduler_config.finalize(self.model_config.max_model_len)
        current_platform.check_and_update_config(self)
        self._check_cache_dtype()

    def _resolve_speculative_config(self) -> None:
        """--speculative-config as a SpeculativeConfig; a draft model's config is read (and checked) here."""
        from fastdeploy.spec_decode.config import SpeculativeConfig

        spec = self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        self.draft_model_config: ModelConfig | None = None
        if spec is not None and spec.method == "draft_model":
            from fastdeploy.spec_decode.draft_model import draft_model_config

            self.draft_model_config = draft_model_config(spec, self.model_config)
        if spec is not None and spec.method == "mtp":
            from fastdeploy.spec_decode.mtp_proposer import check_mtp_target

            check_mtp_target(self)

    def _check_cache_dtype(self) -> None:
        """--kv-cache-dtype: the KV cache is kept in the model's compute dtype; any other is refused by name."""
        cache_dtype = self.cache_config.cache_dtype
        if cache_dtype not in ("auto", self.model_config.dtype):
            raise ValueError(
                f"--kv-cache-dtype {cache_dtype} is not supported by this FastDeploy build yet: the KV cache is "
                f"stored in the model's compute dtype ({self.model_config.dtype}); use --kv-cache-dtype auto"
                + (" or --dtype bfloat16." if cache_dtype == "bfloat16" else ".")
            )
