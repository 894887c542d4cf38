"""The ``fastdeploy`` command: serve, chat, complete, bench, collect-env (vLLM's ``vllm`` command)."""

from __future__ import annotations

import importlib
import sys

from fastdeploy.entrypoints.cli.types import CLISubcommand
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser

# Each entry names a module and its sub-command classes; a sub-command whose module
# is missing (e.g. the benchmarks, built in another change) is simply left out.
_SUBCOMMANDS = (
    ("fastdeploy.entrypoints.cli.serve", "ServeSubcommand"),
    ("fastdeploy.entrypoints.cli.openai", "ChatCommand"),
    ("fastdeploy.entrypoints.cli.openai", "CompleteCommand"),
    ("fastdeploy.entrypoints.cli.benchmark.main", "BenchmarkSubcommand"),
    ("fastdeploy.entrypoints.cli.collect_env", "CollectEnvSubcommand"),
    ("fastdeploy.router.cli", "RouterSubcommand"),
)


def _subcommands() -> list[CLISubcommand]:
    commands = []
    for module_name, class_name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is not None and module_name.startswith(e.name):
                continue
            raise
        commands.append(getattr(module, class_name)())
    return commands


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``fastdeploy`` console script."""
    from fastdeploy.version import __version__

    parser = FlexibleArgumentParser(prog="fastdeploy", description="FastDeploy CLI: LLM serving on PaddlePaddle.",
                                    epilog="Run `fastdeploy <command> --help` for a command's options.")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="subparser", metavar="<command>")
    commands = {}
    for command in _subcommands():
        sub = command.subparser_init(subparsers)
        sub.set_defaults(dispatch_function=command.cmd)
        commands[command.name] = command
    args = parser.parse_args(argv)
    if not hasattr(args, "dispatch_function"):
        parser.print_help()
        sys.exit(1)
    try:
        commands[args.subparser].validate(args)
    except ValueError as e:
        parser.error(str(e))
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
