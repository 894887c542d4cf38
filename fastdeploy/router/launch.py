"""``python -m fastdeploy.router.launch --port 9000 [flags]``: run the router (same flags as ``fastdeploy router``)."""

from __future__ import annotations

import sys

import uvicorn

from fastdeploy.logger import init_logger
from fastdeploy.router.app import build_app
from fastdeploy.router.router import Router, RouterArgs
from fastdeploy.utils.argparse_utils import FlexibleArgumentParser

logger = init_logger("fastdeploy.router.launch")


def run_router(args: RouterArgs) -> int:
    """Serve the router on ``args.host:args.port`` until interrupted; returns the exit code."""
    router = Router(args)
    app = build_app(router)
    logger.info("FastDeploy router on http://%s:%d (policy %s, PD protocol %s)", args.host, args.port, args.policy,
                args.pd_protocol)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        logger.error("%s", e)
        return 1
    return 0


def main(argv: list[str] | None = None) -> None:
    from fastdeploy.router.cli import add_cli_args
    from fastdeploy.router.cli import main as cli_main

    parser = FlexibleArgumentParser(prog="python -m fastdeploy.router.launch",
                                    description="FastDeploy router (same flags as `fastdeploy router`).")
    add_cli_args(parser)
    sys.exit(cli_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
