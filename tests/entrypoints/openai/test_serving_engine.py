"""The user-data guard of request preparation: the client's errors are 400s naming what failed, ours 500s."""

from __future__ import annotations

import logging

import jinja2
import pytest

from fastdeploy.entrypoints.openai.serving_engine import error_from_exception, user_data_guard
from fastdeploy.sampling_params import ParamValidationError


def fail_with(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize(("exc", "fragment"), [
    (IndexError("list index out of range"), "Invalid messages: IndexError: list index out of range"),
    (KeyError("role"), "Invalid messages: KeyError: 'role'"),
    (TypeError("can only concatenate str"), "Invalid messages: TypeError: can only concatenate str"),
    (ZeroDivisionError("division by zero"), "Invalid messages: ZeroDivisionError: division by zero"),
    (jinja2.exceptions.UndefinedError("'x' is undefined"), "Invalid messages: UndefinedError: 'x' is undefined"),
    (RecursionError("too deep"), "Invalid messages: RecursionError: too deep"),
    (ValueError("bad value"), "Invalid messages: bad value"),
])
def test_user_data_errors_become_400s_naming_the_step(exc, fragment):
    with pytest.raises(ParamValidationError) as info:
        with user_data_guard("messages", "messages"):
            fail_with(exc)
    assert info.value.parameter == "messages" and info.value.__cause__ is exc
    error = error_from_exception(info.value).error
    assert (error.code, error.type, error.param, error.message) == (400, "BadRequestError", "messages", fragment)


def test_the_innermost_guard_names_the_error():
    with pytest.raises(ParamValidationError, match="^Invalid tools: KeyError") as info:
        with user_data_guard("request"), user_data_guard("tools", "tools"):
            fail_with(KeyError("name"))
    assert info.value.parameter == "tools"


@pytest.mark.parametrize("exc", [RuntimeError("Already borrowed"), AttributeError("'NoneType' has no 'encode'"),
                                 MemoryError()])
def test_server_faults_pass_the_guard_and_are_logged_500s(exc):
    with pytest.raises(type(exc)):
        with user_data_guard("messages"):
            fail_with(exc)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    # The fastdeploy logger does not propagate to the root one (where caplog listens).
    logger = logging.getLogger("fastdeploy")
    logger.addHandler(handler)
    try:
        error = error_from_exception(exc).error
    finally:
        logger.removeHandler(handler)
    assert (error.code, error.type) == (500, "InternalServerError")
    assert any(r.exc_info and r.exc_info[1] is exc for r in records)
