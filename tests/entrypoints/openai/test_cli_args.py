"""``fastdeploy serve`` flags: vLLM's names and defaults, FastDeploy's, --config, JSON values, rejections."""

from __future__ import annotations

import pytest

from fastdeploy.engine.arg_utils import AsyncEngineArgs
from fastdeploy.entrypoints.openai.cli_args import create_parser, validate_parsed_serve_args


def parse(*argv: str):
    return create_parser().parse_args(list(argv))


def test_vllm_defaults():
    args = parse()
    assert args.port == 8000 and args.host is None
    assert args.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert args.max_logprobs == 20 and args.seed == 0 and args.max_model_len is None
    assert args.response_role == "assistant" and args.uvicorn_log_level == "info"
    assert args.api_key is None and args.allowed_origins == ["*"]
    assert args.enable_prefix_caching is None and args.enable_chunked_prefill is None
    assert args.tensor_parallel_size == 1 and args.data_parallel_size == 1
    assert args.block_size is None and args.gpu_memory_utilization == 0.9 and args.swap_space == 4
    assert args.load_format == "auto" and args.generation_config == "auto" and args.dtype == "auto"


def test_every_compat_flag_is_accepted():
    """COMPAT.md's flags all parse; what the ones without effect do (warn / refuse) is in tests/engine/test_flag_effects.py."""
    args = parse(
        "--host", "127.0.0.1", "--port", "9000", "--served-model-name", "a", "b", "--api-key", "k",
        "--allowed-origins", '["http://x"]', "--uvicorn-log-level", "debug", "--tokenizer", "t", "--revision", "main",
        "--trust-remote-code", "--dtype", "float32", "--seed", "1", "--max-model-len", "1k", "-q", "fp8",
        "--max-logprobs", "5", "--generation-config", "vllm", "--chat-template", "t.jinja", "--response-role", "bot",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
        "--structured-outputs-config", '{"backend": "auto"}', "--guided-decoding-backend", "auto",
        "--block-size", "32", "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", "1G", "--swap-space", "2",
        "--no-enable-prefix-caching", "--enable-chunked-prefill", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "4096", "-tp", "1", "-dp", "1", "--speculative-config", '{"method": "ngram"}',
        "--kv-transfer-config", '{"kv_connector": "x"}', "--enforce-eager", "--disable-log-stats",
        "--enable-log-requests", "--enable-prompt-tokens-details", "--enable-tokenizer-info-endpoint",
        "--return-tokens-as-token-ids", "--load-format", "gguf",
        "--engine-worker-queue-port", "7000", "--metrics-port", "9100", "--cache-queue-port", "7100",
        "--kv-cache-ratio", "0.5", "--model-impl", "fastdeploy", "--splitwise-role", "mixed",
        "--cache-transfer-protocol", "ipc", "--pd-comm-port", "7200", "7201", "--router", "http://r:8",
        "--scheduler-name", "local", "--scheduler-host", "h", "--scheduler-port", "6379", "--scheduler-topic", "t",
        "--graph-optimization-config", '{"use_cudagraph": false}', "--enable-logprob",
        "--kv-cache-dtype", "auto", "--scheduling-policy", "fcfs", "--max-log-len", "100",
    )
    assert args.served_model_name == ["a", "b"] and args.api_key == ["k"]
    assert args.max_model_len == 1000 and args.quantization == "fp8"
    assert args.kv_cache_memory_bytes == 1 << 30 and args.enable_prefix_caching is False
    assert args.speculative_config == {"method": "ngram"} and args.pd_comm_port == [7200, 7201]
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.engine_worker_queue_port == 7000 and engine_args.enable_log_requests


@pytest.mark.parametrize(("value", "expected"), [("2048", 2048), ("1k", 1000), ("1K", 1024), ("32K", 32768),
                                                 ("auto", None), ("-1", None)])
def test_max_model_len_forms(value, expected):
    assert parse("--max-model-len", value).max_model_len == expected


def test_boolean_optional_flags():
    assert parse("--enable-prefix-caching").enable_prefix_caching is True
    assert parse("--no-enable-prefix-caching").enable_prefix_caching is False
    assert parse("--no-enable-chunked-prefill").enable_chunked_prefill is False


def test_underscores_and_dotted_json_flags():
    args = parse("--max_num_seqs", "4", "--speculative-config.method", "ngram",
                 "--speculative-config.num_speculative_tokens", "3")
    assert args.max_num_seqs == 4
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}


def test_config_file(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9001\nmax-model-len: 1k\nenable-prefix-caching: false\nserved_model_name: [x, y]\n"
                      "speculative-config:\n  method: ngram\n")
    args = parse("--config", str(config), "--port", "9002")
    assert args.port == 9002  # the command line wins over the file
    assert args.max_model_len == 1000 and args.enable_prefix_caching is False
    assert args.served_model_name == ["x", "y"] and args.speculative_config == {"method": "ngram"}


def test_unknown_flag_is_an_error_naming_it(capsys):
    with pytest.raises(SystemExit):
        parse("--no-such-flag", "1")
    assert "--no-such-flag" in capsys.readouterr().err


def test_bad_json_value_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse("--speculative-config", "{not json")
    assert "--speculative-config" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "flag"), [
    # The default model's 9 heads do not split over 2 tensor-parallel ranks.
    (["-tp", "2"], r"num_attention_heads \(9\) is not divisible by --tensor-parallel-size"),
    (["-pp", "2"], "--pipeline-parallel-size"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
    (["--scheduler-name", "splitwise"], "--scheduler-name"),
    (["--guided-decoding-backend", "outlines"], "outlines"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "guidance"),
])
def test_unbuilt_engine_features_are_rejected_by_name(argv, flag):
    engine_args = AsyncEngineArgs.from_cli_args(parse(*argv))
    with pytest.raises(ValueError, match=flag):
        engine_args.create_engine_config()


def test_pd_flags_reach_the_kv_transfer_config():
    config = AsyncEngineArgs.from_cli_args(parse(
        "--splitwise-role", "prefill", "--pd-comm-port", "7100", "--cache-transfer-protocol", "rdma",
    )).create_engine_config().kv_transfer_config
    assert (config.role, config.enabled, config.port, config.protocol) == ("prefill", True, 7100, "tcp")
    config = AsyncEngineArgs.from_cli_args(parse(
        "--kv-transfer-config", '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}',
    )).create_engine_config().kv_transfer_config
    assert (config.role, config.enabled, config.kv_connector) == ("decode", True, "NixlConnector")
    with pytest.raises(ValueError, match="kv_role"):
        AsyncEngineArgs.from_cli_args(parse("--kv-transfer-config", '{"kv_role": "kv_sideways"}')
                                      ).create_engine_config()


def test_global_scheduler_flags_reach_the_scheduler_config():
    engine_args = AsyncEngineArgs.from_cli_args(parse(
        "--scheduler-name", "global", "--scheduler-host", "redis.internal", "--scheduler-port", "6380",
        "--scheduler-topic", "demo", "--scheduler-db", "2", "--scheduler-password", "pw", "--scheduler-ttl", "60"))
    sc = engine_args.create_engine_config().scheduler_config
    assert (sc.scheduler_name, sc.scheduler_host, sc.scheduler_port, sc.scheduler_topic) == \
        ("global", "redis.internal", 6380, "demo")
    assert (sc.scheduler_db, sc.scheduler_password, sc.scheduler_ttl) == (2, "pw", 60)


@pytest.mark.parametrize(("argv", "flag"), [
    (["--tool-parser-plugin", "my_parser.py"], "--tool-parser-plugin"),
    (["--lora-modules", "a=/x"], "--lora-modules"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
    (["--tool-call-parser", "nope"], "invalid tool call parser"),
    (["--reasoning-parser", "nope"], "invalid reasoning parser"),
])
def test_bad_frontend_flags_are_rejected_by_name(argv, flag):
    with pytest.raises(ValueError, match=flag):
        validate_parsed_serve_args(parse(*argv))


def test_parser_flags_are_accepted():
    validate_parsed_serve_args(parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                     "--reasoning-parser", "qwen3"))


def test_metrics_port_must_differ():
    with pytest.raises(ValueError, match="--metrics-port"):
        validate_parsed_serve_args(parse("--port", "8000", "--metrics-port", "8000"))


def test_vllm_observability_and_tokenizer_flags_reach_the_engine():
    engine_args = AsyncEngineArgs.from_cli_args(parse("--skip-tokenizer-init", "--show-hidden-metrics-for-version",
                                                      "0.32"))
    assert engine_args.skip_tokenizer_init
    config = engine_args.create_engine_config()
    assert config.model_config.skip_tokenizer_init
    # 0.32 is the minor version before vLLM 0.33, whose metric set FastDeploy follows.
    assert config.observability_config.show_hidden_metrics
    assert not AsyncEngineArgs.from_cli_args(parse("--show-hidden-metrics-for-version", "0.20")
                                             ).create_engine_config().observability_config.show_hidden_metrics
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        AsyncEngineArgs.from_cli_args(parse("--show-hidden-metrics-for-version", "soon")).create_engine_config()


def test_watermarking_is_refused_by_name():
    engine_args = AsyncEngineArgs.from_cli_args(parse("--watermark-config", '{"algorithm": "gumbel", "key": 42}'))
    with pytest.raises(ValueError, match="--watermark-config"):
        engine_args.create_engine_config()


def test_per_request_metrics_need_the_engine_statistics():
    assert parse("--enable-per-request-metrics").enable_per_request_metrics
    assert not parse("--no-enable-per-request-metrics").enable_per_request_metrics
    validate_parsed_serve_args(parse("--enable-per-request-metrics"))
    with pytest.raises(ValueError, match="remove --disable-log-stats"):
        validate_parsed_serve_args(parse("--enable-per-request-metrics", "--disable-log-stats"))


@pytest.mark.parametrize("dtype", ["float16", "half", "fp16"])
def test_float16_is_refused_naming_the_dtypes_that_run(dtype):
    engine_args = AsyncEngineArgs.from_cli_args(parse("--dtype", dtype))
    with pytest.raises(ValueError, match="no float16 kernels.*--dtype auto, bfloat16 or float32"):
        engine_args.create_engine_config()
