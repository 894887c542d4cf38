"""``fastdeploy serve [MODEL] [flags]``: the OpenAI-compatible server (``vllm serve``)."""

from __future__ import annotations

import argparse
import sys

from fastdeploy.entrypoints.cli.types import CLISubcommand
from fastdeploy.entrypoints.openai.cli_args import make_arg_parser
from fastdeploy.logger import init_logger

logger = init_logger(__name__)


class ServeSubcommand(CLISubcommand):
    name = "serve"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name, help="Start the OpenAI-compatible API server.", usage="fastdeploy serve [MODEL] [options]",
            description="Start the OpenAI-compatible API server (same flags as `vllm serve`).")
        parser.add_argument("model_tag", type=str, nargs="?", default=None,
                            help="The model to serve (default: the embedded SmolLM2-135M-Instruct); same as --model.")
        make_arg_parser(parser)
        # None tells validate() that --model was not given, so the positional model or the default applies.
        self.default_model = parser.get_default("model")
        parser.set_defaults(model=None)
        return parser

    def validate(self, args: argparse.Namespace) -> None:
        if args.model_tag is not None:
            if args.model is not None and args.model != args.model_tag:
                logger.warning("The model is given both as %r and with --model %r; serving %r.",
                               args.model_tag, args.model, args.model_tag)
            args.model = args.model_tag
        elif args.model is None:
            args.model = self.default_model

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        if getattr(args, "headless", False):
            sys.exit(run_headless_node(args))
        from fastdeploy.entrypoints.openai.api_server import run

        sys.exit(run(args))


def run_headless_node(args: argparse.Namespace) -> int:
    """``--headless``: a worker node starts its tensor-parallel ranks, which join the head node's engine."""
    from fastdeploy.engine.arg_utils import EngineArgs
    from fastdeploy.executor.multiproc_executor import run_headless

    if args.node_rank == 0:
        raise ValueError("--headless runs a worker node: give it --node-rank 1 or more (node 0 runs the engine).")
    return run_headless(EngineArgs.from_cli_args(args).create_engine_config())
