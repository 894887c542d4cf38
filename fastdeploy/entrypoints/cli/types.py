"""The interface every ``fastdeploy`` sub-command implements (vLLM's ``CLISubcommand``)."""

from __future__ import annotations

import argparse


class CLISubcommand:
    """A sub-command: adds its parser, validates its arguments, runs."""

    name: str

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        raise NotImplementedError

    def validate(self, args: argparse.Namespace) -> None:
        """Reject bad argument combinations before running (raise ValueError)."""

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        raise NotImplementedError
