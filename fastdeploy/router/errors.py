"""Errors the router answers with, in the server's OpenAI-style envelope."""

from __future__ import annotations

import json
import uuid

from fastapi.responses import JSONResponse

from fastdeploy.router.instance import InstanceState


class RouterError(Exception):
    """A request the router cannot serve; becomes an OpenAI-style error response."""

    def __init__(self, message: str, status: int = 502, err_type: str = "BadGatewayError") -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type


class NoInstanceError(RouterError):
    """No healthy instance of the wanted role."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 503, "ServiceUnavailableError")


class ConnectFailed(Exception):
    """The connection to an instance was refused before anything was sent (safe to retry elsewhere)."""


def error_response(message: str, status: int, err_type: str) -> JSONResponse:
    """The server's error envelope (COMPAT: ``{"error": {message, type, param, code}}``)."""
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None, "code": status}},
                        status_code=status)


def sse_error(message: str, status: int = 502, err_type: str = "BadGatewayError") -> bytes:
    """An error after streaming started: one ``data: {"error": ...}`` event, then ``[DONE]``."""
    payload = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return f"data: {json.dumps(payload)}\n\ndata: [DONE]\n\n".encode()


def describe(error: BaseException) -> str:
    """``Type: message`` of an exception (httpx errors often have an empty message)."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def failed_message(instance: InstanceState, error: BaseException) -> str:
    return (f"{instance.role.value.capitalize()} instance {instance.id} failed while serving the request "
            f"({describe(error)}).")


def error_message(content: bytes) -> str:
    """The message of an instance's error body (its raw text when it is not the envelope)."""
    try:
        return str(json.loads(content)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return content.decode("utf-8", "replace")[:500]


def new_request_id() -> str:
    return f"router-{uuid.uuid4().hex}"
