"""``python -m fastdeploy.router.launch --port 9000 [flags]``: run the router (same flags as ``fastdeploy router``)."""

from __future__ import annotations

import sys

from fastdeploy.router.cli import add_cli_args
from fastdeploy.router.cli import main as cli_main
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser


def main(argv: list[str] | None = None) -> None:
    parser = FlexibleArgumentParser(prog="python -m fastdeploy.router.launch",
                                    description="FastDeploy router (same flags as `fastdeploy router`).")
    add_cli_args(parser)
    sys.exit(cli_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
