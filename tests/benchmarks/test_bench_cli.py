"""``fastdeploy bench serve|latency|throughput``: vLLM's flag names and defaults."""

from __future__ import annotations

import math
from datetime import datetime

import pytest

from fastdeploy.benchmarks.serve import _api_urls, _parse_metadata, result_filename
from fastdeploy.entrypoints.cli.main import main
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser


def parse(*argv: str):
    """Parse like the ``fastdeploy`` command does, without running anything."""
    from fastdeploy.entrypoints.cli.benchmark.main import BenchmarkSubcommand

    parser = FlexibleArgumentParser(prog="fastdeploy")
    BenchmarkSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser.parse_args(["bench", *argv])


def test_serve_defaults():
    args = parse("serve")
    assert args.backend == "openai" and args.dataset_name == "random" and args.num_prompts == 1000
    assert math.isinf(args.request_rate) and args.burstiness == 1.0 and args.max_concurrency is None
    assert args.random_input_len == 1024 and args.random_output_len == 128 and args.random_range_ratio == 0.0
    assert args.percentile_metrics == "ttft,tpot,itl" and args.metric_percentiles == "99"
    assert (args.host, args.port, args.seed) == ("127.0.0.1", 8000, 0)
    assert _api_urls(args) == ("http://127.0.0.1:8000/v1/completions", "http://127.0.0.1:8000")


def test_serve_flags():
    args = parse("serve", "--backend", "openai-chat", "--base-url", "http://h:1/", "--model", "m",
                 "--tokenizer", "t", "--dataset-name", "prefix_repetition", "--num-prompts", "20",
                 "--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "4",
                 "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "3",
                 "--max-concurrency", "4", "--request-rate", "2.5", "--burstiness", "0.5", "--ignore-eos",
                 "--save-result", "--result-dir", "out", "--result-filename", "r.json", "--metadata", "a=1", "b=x=y",
                 "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9", "--disable-tqdm",
                 "--random-prefix-len", "5")
    assert _api_urls(args) == ("http://h:1/v1/chat/completions", "http://h:1")
    assert args.prefix_repetition_num_prefixes == 2 and args.random_prefix_len == 5
    assert args.request_rate == 2.5 and args.burstiness == 0.5 and args.ignore_eos and args.disable_tqdm
    assert _parse_metadata(args.metadata) == {"a": "1", "b": "x=y"}
    assert parse("serve", "--backend", "vllm", "--endpoint", "/v1/x/completions").endpoint == "/v1/x/completions"
    with pytest.raises(SystemExit):
        parse("serve", "--dataset-name", "sonnet")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        _parse_metadata(["novalue"])


def test_result_filename_as_vllm():
    args = parse("serve", "--max-concurrency", "16")
    when = datetime(2026, 1, 2, 3, 4, 5)
    name = result_filename(args, "HuggingFaceTB/SmolLM2-135M-Instruct", when)
    assert name == "openai-infqps-concurrency16-SmolLM2-135M-Instruct-20260102-030405.json"


def test_latency_and_throughput_flags():
    args = parse("latency", "--input-len", "16", "--output-len", "8", "--batch-size", "2", "--num-iters-warmup", "1",
                 "--num-iters", "3", "--output-json", "l.json", "--max-model-len", "512")
    assert (args.input_len, args.output_len, args.batch_size, args.num_iters_warmup, args.num_iters) == (16, 8, 2, 1, 3)
    assert args.max_model_len == 512 and args.output_json == "l.json"
    defaults = parse("latency")
    assert (defaults.input_len, defaults.output_len, defaults.batch_size) == (32, 128, 8)
    assert (defaults.num_iters_warmup, defaults.num_iters) == (10, 30)
    args = parse("throughput", "--dataset-name", "random", "--num-prompts", "4", "--input-len", "32",
                 "--output-len", "8", "--output-json", "t.json", "--max-num-seqs", "4")
    assert (args.num_prompts, args.input_len, args.output_len, args.max_num_seqs) == (4, 32, 8, 4)


def test_bench_needs_a_type(capsys):
    with pytest.raises(SystemExit):
        main(["bench"])
    with pytest.raises(SystemExit):
        main(["bench", "nope"])
