"""``fastdeploy bench serve|latency|throughput`` (vLLM's ``vllm bench``)."""

from __future__ import annotations

import argparse
import importlib

from fastdeploy.entrypoints.cli.types import CLISubcommand

# Sub-command -> (module under fastdeploy.benchmarks, help). Each module has add_cli_args(parser) and main(args);
# modules are imported on use so `fastdeploy --help` stays fast and needs no engine.
BENCH_TYPES = {
    "serve": ("serve", "Online serving benchmark against a running OpenAI-compatible server."),
    "latency": ("latency", "Offline latency of one batch through the LLM engine."),
    "throughput": ("throughput", "Offline throughput of a dataset through the LLM engine."),
}


def _module(bench_type: str):
    return importlib.import_module(f"fastdeploy.benchmarks.{BENCH_TYPES[bench_type][0]}")


class BenchmarkSubcommand(CLISubcommand):
    name = "bench"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help="Benchmarks: serve, latency, throughput (vLLM's flags).",
                                       usage="fastdeploy bench {serve,latency,throughput} [options]",
                                       description="Benchmarks with the flags, tables and JSON keys of `vllm bench`.")
        bench_parsers = parser.add_subparsers(dest="bench_type", required=True, metavar="{serve,latency,throughput}")
        for bench_type, (_, help_text) in BENCH_TYPES.items():
            sub = bench_parsers.add_parser(bench_type, help=help_text, description=help_text,
                                           usage=f"fastdeploy bench {bench_type} [options]")
            _module(bench_type).add_cli_args(sub)
        return parser

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        _module(args.bench_type).main(args)
