"""The fastdeploy logger: one handler, concise format, level from FD_LOGGING_LEVEL."""

from __future__ import annotations

import logging
import sys

_ROOT = "fastdeploy"
_configured = False


def _configure() -> None:
    global _configured
    if _configured:
        return
    from fastdeploy import envs

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s", "%m-%d %H:%M:%S")
    )
    root = logging.getLogger(_ROOT)
    root.addHandler(handler)
    root.setLevel(envs.logging_level())
    root.propagate = False
    _configured = True


def init_logger(name: str) -> logging.Logger:
    """Logger for a fastdeploy module."""
    _configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
