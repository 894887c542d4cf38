"""The engine's command-line flags: vLLM's names and defaults, plus FastDeploy's own.

Kept apart from :mod:`fastdeploy.engine.arg_utils` so the dataclass stays readable;
``EngineArgs.add_cli_args`` calls :func:`add_engine_cli_args`. Imports go one way only:
``arg_utils`` -> ``cli_args`` -> ``utils.argparse_utils`` (which imports neither), so none
of the three imports a module that imports it back.
"""

from __future__ import annotations

import argparse

from fastdeploy.utils.argparse_utils import optional_json, parse_size

# vLLM's --kv-cache-dtype values; "auto" stores the KV cache in the model's compute dtype.
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


def max_model_len_type(value: str) -> int | None:
    """``--max-model-len``: ``2048``, ``1k``, ``32K``; ``-1``/``auto`` mean "as the model allows"."""
    if value.strip().lower() in ("-1", "auto"):
        return None
    return parse_size(value)


def size_type(value: str) -> int:
    """A byte or token count with an optional k/K/m/M/g/G suffix."""
    return parse_size(value)


def _model_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ModelConfig")
    g.add_argument("--model", type=str, default=None,
                   help="Local model folder, GGUF file, or the default model's name (the embedded SmolLM2-135M-Instruct).")
    g.add_argument("--tokenizer", type=str, default=None, help="Tokenizer folder when it differs from the model's.")
    g.add_argument("--tokenizer-mode", type=str, default="auto", choices=["auto", "slow"], help="Tokenizer mode.")
    g.add_argument("--trust-remote-code", action="store_true", help="Trust remote code from Hugging Face.")
    g.add_argument("--revision", type=str, default=None,
                   help="Model revision (local files only: no effect, warns when set).")
    g.add_argument("--dtype", type=str, default="auto",
                   choices=["auto", "half", "float16", "bfloat16", "float", "float32", "fp16", "bf16", "fp32"],
                   help="Data type of weights and activations.")
    g.add_argument("--seed", type=int, default=0, help="Random seed.")
    g.add_argument("--max-model-len", type=max_model_len_type, default=None,
                   help="Context length (prompt + output); accepts 1k (1000), 1K (1024), 32K, -1/auto.")
    g.add_argument("--quantization", "-q", type=str, default=None,
                   help="Quantization method of the weights (default: the checkpoint's; 'gguf' for a GGUF file, "
                        "'none' dequantizes it at load).")
    g.add_argument("--load-format", type=str, default="auto", choices=["auto", "safetensors", "gguf", "dummy", "pt"],
                   help="Checkpoint format.")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="Most logprobs a request may ask for (-1 = no limit).")
    g.add_argument("--generation-config", type=str, default="auto",
                   help="Folder of generation_config.json ('auto' = the model's, 'vllm' = none).")
    g.add_argument("--enforce-eager", action="store_true", help="Always run eagerly (no graph capture; on CPU always so: warns).")
    g.add_argument("--model-impl", type=str, default="auto", choices=["auto", "fastdeploy", "paddleformers"],
                   help="Model implementation.")
    g.add_argument("--limit-mm-per-prompt", type=optional_json, default=None,
                   help='Most multimodal items per prompt, per modality, e.g. \'{"image": 2}\' (default 999 each).')
    g.add_argument("--allowed-local-media-path", type=str, default="",
                   help="Folder that file:// media URLs may read from (none when empty).")
    g.add_argument("--allowed-media-domains", type=str, nargs="+", default=None,
                   help="Only media URLs whose host is one of these may be fetched (any host when unset).")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="Load no tokenizer: prompts must be token ids, outputs carry token ids and no text.")
    g.add_argument("--served-model-name", type=str, nargs="+", default=None,
                   help="Model name(s) used in the API; the first is reported in responses.")


def _cache_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("CacheConfig")
    g.add_argument("--block-size", type=int, default=None, choices=[1, 8, 16, 32, 64, 128, 256],
                   help="Tokens per KV-cache block (default 16).")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="Fraction of device memory for the model and KV cache (GPU platforms; warns on CPU).")
    g.add_argument("--kv-cache-memory-bytes", type=size_type, default=None,
                   help="KV-cache size in bytes (accepts 1G, 512M); on CPU the default is FD_CPU_KVCACHE_SPACE GiB.")
    g.add_argument("--swap-space", type=float, default=4,
                   help="CPU swap space per device, GiB (no effect: preemption recomputes; warns when set).")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="Reuse KV blocks of shared prompt prefixes (default on).")
    g.add_argument("--kv-cache-dtype", type=str, default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache dtype; 'auto' = the model's compute dtype (fp8 has no kernel yet: refused).")
    g.add_argument("--kv-cache-ratio", type=float, default=0.75,
                   help="FastDeploy: share of blocks for prefill (no effect: one shared pool; warns when set).")


def _scheduler_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("SchedulerConfig")
    g.add_argument("--max-num-seqs", type=int, default=None, help="Most sequences in one batch (default 256).")
    g.add_argument("--max-num-batched-tokens", type=size_type, default=None, help="Token budget of one step.")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="Split long prefills across steps (default on).")
    g.add_argument("--scheduling-policy", type=str, default="fcfs", choices=["fcfs", "priority"],
                   help="Order of serving requests: fcfs (priority scheduling is not built: refused).")
    g.add_argument("--scheduler-name", type=str, default="local", choices=["local", "global", "splitwise"],
                   help="FastDeploy scheduler: local, or global (instances share a request queue in Redis).")
    g.add_argument("--scheduler-host", type=str, default=None, help="Redis host of the global scheduler.")
    g.add_argument("--scheduler-port", type=int, default=None, help="Redis port of the global scheduler.")
    g.add_argument("--scheduler-topic", type=str, default=None,
                   help="Topic of the global scheduler: instances with the same topic share their work.")
    g.add_argument("--scheduler-db", type=int, default=None, help="Redis database of the global scheduler.")
    g.add_argument("--scheduler-password", type=str, default=None, help="Redis password of the global scheduler.")
    g.add_argument("--scheduler-ttl", type=int, default=None,
                   help="Seconds the global scheduler's queues and results live in Redis untouched (default 900).")


def _parallel_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("ParallelConfig")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="Tensor-parallel ranks.")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="Pipeline stages.")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="Data-parallel replicas.")
    g.add_argument("--nnodes", "-n", type=int, default=1, help="Nodes the tensor-parallel ranks run on.")
    g.add_argument("--node-rank", "-r", type=int, default=0,
                   help="This node's rank (0: the head, which runs the engine; others run with --headless).")
    g.add_argument("--headless", action="store_true",
                   help="Run only this node's tensor-parallel ranks (a worker node, --node-rank > 0): no API server.")
    g.add_argument("--master-addr", type=str, default="127.0.0.1",
                   help="Address of the head node (the tensor-parallel group's store).")
    g.add_argument("--master-port", type=int, default=0,
                   help="Port of the group's store on the head node (the next port is the executor's); "
                        "0: a free one (one node only).")


def _deployment_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("FastDeploy deployment")
    g.add_argument("--engine-worker-queue-port", type=int, default=None,
                   help="TCP port of the engine core's request socket (the reply socket uses the next port); "
                        "default: local IPC sockets.")
    g.add_argument("--cache-queue-port", type=int, default=None,
                   help="FastDeploy's KV-cache transfer queue port (no effect: no such queue; warns when set).")
    g.add_argument("--splitwise-role", type=str, default="mixed", choices=["mixed", "prefill", "decode"],
                   help="Role in prefill/decode disaggregation.")
    g.add_argument("--cache-transfer-protocol", type=str, default=None, help="KV transfer protocol (ipc, rdma, ...).")
    g.add_argument("--pd-comm-port", type=int, nargs="+", default=None, help="Ports for PD communication.")
    g.add_argument("--router", type=str, default=None, help="URL of the router to register with.")
    g.add_argument("--enable-logprob", action="store_true",
                   help="Accepted for FastDeploy scripts; logprobs are always available (warns when set).")
    g.add_argument("--disable-log-stats", action="store_true", help="Do not log throughput statistics.")
    g.add_argument("--show-hidden-metrics-for-version", type=str, default=None,
                   help="Export again the metrics hidden since this version's next release (vLLM's escape "
                        "hatch; e.g. 0.32 for the 0.33 metric set FastDeploy follows).")


def _feature_group(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Features")
    for flag, what in (
        ("--speculative-config", "Speculative decoding config"),
        ("--kv-transfer-config", "KV transfer config for disaggregated serving"),
        ("--structured-outputs-config", "Structured outputs config"),
        ("--graph-optimization-config", "FastDeploy graph optimization config (CUDA graphs; warns on CPU)"),
        ("--watermark-config", "vLLM's text watermarking config (not built yet: refused)"),
    ):
        g.add_argument(flag, type=optional_json, default=None, help=f"{what} (JSON, or --{flag[2:]}.KEY VALUE).")
    g.add_argument("--guided-decoding-backend", type=str, default=None,
                   help="Legacy name of the structured outputs backend.")


def add_engine_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags to ``parser`` and return it."""
    _model_group(parser)
    _cache_group(parser)
    _scheduler_group(parser)
    _parallel_group(parser)
    _deployment_group(parser)
    _feature_group(parser)
    return parser
