"""``fastdeploy bench serve|latency|throughput``: placeholder until the benchmarks are built.

It accepts vLLM's ``bench`` sub-commands and fails with a clear message rather
than an "invalid choice" error.
"""

from __future__ import annotations

import argparse
import sys

from fastdeploy.entrypoints.cli.types import CLISubcommand

BENCH_TYPES = ("serve", "latency", "throughput")


class BenchmarkSubcommand(CLISubcommand):
    name = "bench"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, help="Benchmarks (not built yet).",
                                       usage="fastdeploy bench {serve,latency,throughput} [options]")
        parser.add_argument("bench_type", choices=BENCH_TYPES, help="Which benchmark.")
        parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="Options of the benchmark.")
        return parser

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        print(f"fastdeploy bench {args.bench_type}: the benchmarks are not built yet in this FastDeploy version.",
              file=sys.stderr)
        sys.exit(1)
