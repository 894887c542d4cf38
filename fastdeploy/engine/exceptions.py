"""Errors raised by the engine client when the engine core process fails (vLLM's names)."""

from __future__ import annotations


class EngineGenerateError(Exception):
    """A request failed inside the engine, which keeps running."""


class EngineDeadError(Exception):
    """The engine core process died or hit an unrecoverable error; no request can run any more."""

    def __init__(self, message: str = "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                 *, suppress_context: bool = False) -> None:
        super().__init__(message)
        # The root cause is logged by the engine process; a chained traceback here only adds noise.
        self.__suppress_context__ = suppress_context
