"""The OpenAI-compatible HTTP server (FastAPI + uvicorn), a drop-in for ``vllm serve``.

``python -m fastdeploy.entrypoints.openai.api_server --model MODEL [flags]`` or
``fastdeploy serve [MODEL] [flags]``. The engine core runs in a child process;
if it dies, /health turns 503, in-flight requests end with an error and the
server exits with a non-zero code.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hmac
import signal
import socket
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy import envs
from fastdeploy.engine.arg_utils import AsyncEngineArgs
from fastdeploy.engine.async_llm import AsyncLLM
from fastdeploy.engine.exceptions import EngineDeadError
from fastdeploy.entrypoints.openai.chat_parsing import ChatParserConfig
from fastdeploy.entrypoints.openai.cli_args import create_parser, validate_parsed_serve_args
from fastdeploy.entrypoints.openai.protocol import (
    UNION_TAG_PREFIX,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    TokenizeRequest,
    TokenizeResponse,
)
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat, load_chat_template
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion
from fastdeploy.entrypoints.openai.serving_engine import error_from_exception, error_response
from fastdeploy.entrypoints.openai.serving_models import BaseModelPath, OpenAIServingModels
from fastdeploy.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_binding import bind_process
from fastdeploy.router.registration import InstanceHooks
from fastdeploy.sampling_params import ParamValidationError
from fastdeploy.utils.gc_utils import freeze_gc_heap
from fastdeploy.version import __version__

logger = init_logger("fastdeploy.entrypoints.openai.api_server")

# After the engine dies the server keeps answering (/health 503) this long, then exits.
ENGINE_DEAD_EXIT_DELAY_S = 1.0
ENGINE_DEAD_EXIT_CODE = 1

router = APIRouter()


# ---- helpers ---------------------------------------------------------------------------------
def engine_client(request: Request) -> AsyncLLM:
    return request.app.state.engine_client


def to_response(result: Any, headers: dict[str, str] | None = None) -> Response:
    """A handler result as an HTTP response: error envelope, JSON body, or an SSE stream."""
    if isinstance(result, ErrorResponse):
        return Response(result.model_dump_json(), status_code=result.error.code, media_type="application/json",
                        headers=headers)
    if isinstance(result, BaseModel):
        return Response(result.model_dump_json(), media_type="application/json")
    return StreamingResponse(result, media_type="text/event-stream")


async def listen_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response | None]]:
    """Cancel the handler (and so abort its engine requests) when the client goes away mid-request."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response | None:
        request: Request = kwargs["raw_request"]
        handler_task = asyncio.create_task(handler(*args, **kwargs))
        disconnect_task = asyncio.create_task(listen_for_disconnect(request))
        done, pending = await asyncio.wait((handler_task, disconnect_task), return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if handler_task in done:
            return handler_task.result()
        return None

    return wrapper


def load_tracked(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Count the request in /load's server_load until its response (streamed or not) is done."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        state = kwargs["raw_request"].app.state
        state.server_load_metrics += 1
        try:
            response = await handler(*args, **kwargs)
        except BaseException:
            state.server_load_metrics -= 1
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = _count_until_done(response.body_iterator, state)
        else:
            state.server_load_metrics -= 1
        return response

    return wrapper


async def _count_until_done(body: AsyncGenerator, state: Any) -> AsyncGenerator:
    try:
        async for chunk in body:
            yield chunk
    finally:
        state.server_load_metrics -= 1


# ---- OpenAPI ---------------------------------------------------------------------------------
_ERROR_STATUSES = {
    HTTPStatus.BAD_REQUEST: "Malformed request or invalid parameter (BadRequestError).",
    HTTPStatus.UNAUTHORIZED: "Missing or wrong API key (AuthenticationError), when the server has one.",
    HTTPStatus.NOT_FOUND: "The requested model is not served (NotFoundError).",
}


def api_responses(model: type[BaseModel], *, streams: bool = False,
                  authenticated: bool = True) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI responses of an operation: its body model, and vLLM's error envelope for every error.

    ``authenticated``: the route is under /v1, where --api-key applies (a 401 is possible).

    ``default`` covers the statuses not listed (500, 503); it also replaces FastAPI's 422, which
    this server never sends (bad bodies are 400s).
    """
    ok: dict[str, Any] = {"model": model, "description": "Successful response."}
    if streams:
        ok["description"] = (f"A {model.__name__}, or with `stream: true` server-sent events: `data: <chunk JSON>` "
                             "lines, the last `data: [DONE]`.")
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    errors = {int(status): {"model": ErrorResponse, "description": text} for status, text in _ERROR_STATUSES.items()
              if authenticated or status != HTTPStatus.UNAUTHORIZED}
    return {200: ok, **errors, "default": {"model": ErrorResponse, "description": "Server error (error envelope)."}}


async def require_json(raw_request: Request) -> None:
    """A request body must be JSON: another Content-Type is a 400 naming it, as vLLM answers."""
    media_type = raw_request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise RequestValidationError(["Unsupported Media Type: Only 'application/json' is allowed"])


JSON_BODY = [Depends(require_json)]


# ---- routes ----------------------------------------------------------------------------------
@router.get("/health")
async def health(raw_request: Request) -> Response:
    """200 while the engine is alive, 503 once it is dead."""
    status = HTTPStatus.SERVICE_UNAVAILABLE if engine_client(raw_request).errored else HTTPStatus.OK
    return Response(status_code=status)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(raw_request: Request) -> Response:
    return await health(raw_request)


@router.get("/load")
async def load(raw_request: Request) -> JSONResponse:
    return JSONResponse({"server_load": raw_request.app.state.server_load_metrics})


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(generate_latest(engine_client(raw_request).prometheus_registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> Response:
    return to_response(raw_request.app.state.openai_serving_models.show_available_models())


@router.get("/v1/models/{model_name:path}", response_model=None, responses=api_responses(ModelCard))
async def retrieve_model(model_name: str, raw_request: Request) -> Response:
    """One served model's card (the OpenAI SDK's ``models.retrieve``); 404 for a name not served."""
    card = raw_request.app.state.openai_serving_models.model_card(model_name)
    if card is None:
        return to_response(error_response(f"The model `{model_name}` does not exist.", "NotFoundError",
                                          HTTPStatus.NOT_FOUND, param="model"))
    return to_response(card)


@router.post("/tokenize", response_model=None, dependencies=JSON_BODY,
             responses=api_responses(TokenizeResponse, authenticated=False))
async def tokenize(request: TokenizeRequest, raw_request: Request) -> Response:
    return to_response(await raw_request.app.state.openai_serving_tokenization.create_tokenize(request))


@router.post("/detokenize", response_model=None, dependencies=JSON_BODY,
             responses=api_responses(DetokenizeResponse, authenticated=False))
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> Response:
    return to_response(await raw_request.app.state.openai_serving_tokenization.create_detokenize(request))


async def tokenizer_info(raw_request: Request) -> JSONResponse:
    """GET /tokenizer_info, registered only with --enable-tokenizer-info-endpoint."""
    return JSONResponse(raw_request.app.state.openai_serving_tokenization.tokenizer_info())


@router.post("/v1/completions", response_model=None, dependencies=JSON_BODY,
             responses=api_responses(CompletionResponse, streams=True))
@load_tracked
@with_cancellation
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    return to_response(await raw_request.app.state.openai_serving_completion.create_completion(request, raw_request))


@router.post("/v1/chat/completions", response_model=None, dependencies=JSON_BODY,
             responses=api_responses(ChatCompletionResponse, streams=True))
@load_tracked
@with_cancellation
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving = raw_request.app.state.openai_serving_chat
    return to_response(await serving.create_chat_completion(request, raw_request))


# vLLM's SageMaker-style route: the body is validated as each request type in turn and served by the
# endpoint of the first that accepts it (chat before completion, vLLM's order).
def _invocation_types() -> tuple[tuple[type[BaseModel], Callable[..., Awaitable[Response]]], ...]:
    return ((ChatCompletionRequest, create_chat_completion), (CompletionRequest, create_completion))


@router.post("/invocations", response_model=None, dependencies=JSON_BODY,
             responses=api_responses(ChatCompletionResponse, streams=True, authenticated=False))
async def invocations(raw_request: Request) -> Response:
    """POST /invocations: a chat completion or a completion, told apart by the body (SageMaker's route)."""
    try:
        body = await raw_request.json()
    except ValueError as e:  # json.JSONDecodeError, or bytes that are not UTF-8
        return to_response(error_response(f"JSON decode error: {e}"))
    for request_type, endpoint in _invocation_types():
        try:
            request = request_type.model_validate(body)
        except ValidationError:
            continue
        return await endpoint(request, raw_request=raw_request)
    names = [request_type.__name__ for request_type, _ in _invocation_types()]
    return to_response(error_response(f"Cannot find suitable handler for request. Expected one of: {names}"))


# ---- error handlers --------------------------------------------------------------------------
_NOT_FIELDS = ("function-", UNION_TAG_PREFIX)

# A malformed body's errors are listed as vLLM lists them, bounded: pydantic repeats the whole
# offending value in every error, so a big bad body would otherwise come back many times over.
_MAX_LISTED_ERRORS = 10
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000


# Segments pydantic puts in ``loc`` for a union member or a wrapper, not fields: a union member's
# type ("str", "list[int]", "constrained-int"), a validator ("function-wrap[...]"), a schema kind.
_SCHEMA_KINDS = frozenset({"str", "int", "float", "bool", "bytes", "list", "tuple", "dict", "set", "none",
                           "constrained-int", "constrained-str", "json-or-python", "lax-or-strict", "chain",
                           "nullable", "tagged-union", "union", "default", "is-instance"})


def _is_field(segment: Any) -> bool:
    text = str(segment)
    return not (text.startswith(_NOT_FIELDS) or text in _SCHEMA_KINDS or any(c in text for c in "[](){}"))


def _field_path(loc: Any) -> list[str]:
    """The field names and indexes of a pydantic ``loc``, without union members and validator names."""
    return [str(p) for p in loc or () if _is_field(p)]


def _bounded(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "...[truncated]"


def _error_line(err: Any) -> str:
    """One validation error in vLLM's wording: pydantic's error dict with the field path as a dotted
    ``loc`` ('body.seed') and a container ``input`` described by its size rather than echoed."""
    if isinstance(err, dict):
        err = dict(err)
        if "loc" in err:
            err["loc"] = ".".join(_field_path(err["loc"]))
        if "input" in err:
            value = err["input"]
            if isinstance(value, (list, tuple, dict, set, frozenset)):
                err["input"] = f"<{type(value).__name__} of {len(value)} items>"
            else:
                err["input"] = _bounded(str(value), _MAX_ERROR_INPUT_CHARS)
    return _bounded(str(err), _MAX_ERROR_CHARS)


async def validation_exception_handler(_: Request, exc: RequestValidationError) -> Response:
    """A malformed body is a 400 BadRequestError (never FastAPI's 422), naming the parameter.

    A check of ours names its parameter and says what is wrong in vLLM's words; anything else
    pydantic found is listed as vLLM lists it: "1 validation error:" then one line per error
    (e.g. {'type': 'less_than_equal', 'loc': 'body.seed', 'msg': 'Input should be ...', ...}).
    """
    errors = exc.errors()
    param = None
    for err in errors:
        cause = (err.get("ctx") or {}).get("error") if isinstance(err, dict) else None
        if isinstance(cause, ParamValidationError):
            return to_response(error_response(str(cause), param=cause.parameter))
        fields = [p for p in _field_path(err.get("loc")) if p != "body"] if isinstance(err, dict) else []
        if param is None and fields:
            param = fields[0]
    if not errors:
        return to_response(error_response("Validation error", param=param))
    label = "error" if len(errors) == 1 else "errors"
    lines = [f"  {_error_line(err)}" for err in errors[:_MAX_LISTED_ERRORS]]
    if len(errors) > _MAX_LISTED_ERRORS:
        lines.append(f"  ...and {len(errors) - _MAX_LISTED_ERRORS} more {label}")
    return to_response(error_response("\n".join([f"{len(errors)} validation {label}:", *lines]), param=param))


async def http_exception_handler(_: Request, exc: StarletteHTTPException) -> Response:
    status = HTTPStatus(exc.status_code)
    # A body FastAPI cannot parse raises a 400 HTTPException: the same BadRequestError as any bad body.
    err_type = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code,
                                                                                               status.phrase)
    # Starlette's 405 names the allowed methods in an Allow header (RFC 9110): keep it.
    return to_response(error_response(str(exc.detail), err_type, exc.status_code), headers=exc.headers)


async def generic_exception_handler(_: Request, exc: Exception) -> Response:
    return to_response(error_from_exception(exc))


# ---- middleware (pure ASGI, so streaming and disconnect detection are untouched) -------------
class AuthenticationMiddleware:
    """``Authorization: Bearer <key>`` on /v1 routes when an API key is set; else 401.

    The scheme is case-insensitive (RFC 9110 section 11.1; vLLM compares it so too): ``bearer KEY``
    is accepted. The key itself is compared exactly, in constant time.
    """

    def __init__(self, app: Any, api_keys: list[str]) -> None:
        self.app = app
        self.api_keys = [key.encode() for key in api_keys]

    def authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # Every key is compared, so the time taken does not tell which one matched.
        return any([hmac.compare_digest(token, key) for key in self.api_keys])

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS":
            path = scope["path"].removeprefix(scope.get("root_path", ""))
            if path.startswith("/v1"):
                if not self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
                    response = to_response(error_response("Unauthorized", "AuthenticationError",
                                                          HTTPStatus.UNAUTHORIZED))
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)


class MetricsPortMiddleware:
    """On --metrics-port only /metrics is served."""

    def __init__(self, app: Any, metrics_port: int) -> None:
        self.app = app
        self.metrics_port = metrics_port

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and (scope.get("server") or (None, None))[1] == self.metrics_port:
            if scope["path"] != "/metrics":
                await to_response(error_response("Not Found", "NotFoundError", HTTPStatus.NOT_FOUND))(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdHeaderMiddleware:
    """--enable-request-id-headers: echo X-Request-Id (or a new one) on every response."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from fastdeploy.entrypoints.openai.protocol import random_uuid

        request_id = dict(scope["headers"]).get(b"x-request-id") or random_uuid().encode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


# ---- app -------------------------------------------------------------------------------------
def api_keys_from(args: argparse.Namespace) -> list[str]:
    if args.api_key:
        return list(args.api_key)
    key = envs.api_key()
    return [key] if key else []


def build_app(args: argparse.Namespace) -> FastAPI:
    """The FastAPI app with every route, error handler and middleware."""
    docs = not args.disable_fastapi_docs
    app = FastAPI(openapi_url="/openapi.json" if docs else None, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None)
    # --root-path: the prefix a path-based proxy serves the app under (vLLM's flag); requests answer
    # with and without it. Set on the app (FastAPI deprecates the constructor argument).
    app.root_path = args.root_path or ""
    app.include_router(router)
    if args.enable_tokenizer_info_endpoint:
        app.add_api_route("/tokenizer_info", tokenizer_info, methods=["GET"])
    app.add_exception_handler(RequestValidationError, validation_exception_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(Exception, generic_exception_handler)
    app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_credentials=args.allow_credentials,
                       allow_methods=args.allowed_methods, allow_headers=args.allowed_headers)
    if keys := api_keys_from(args):
        app.add_middleware(AuthenticationMiddleware, api_keys=keys)
    if args.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    if args.metrics_port is not None:
        app.add_middleware(MetricsPortMiddleware, metrics_port=args.metrics_port)
    return app


def init_app_state(engine: AsyncLLM, state: Any, args: argparse.Namespace) -> None:
    """Attach the engine and the endpoint handlers to ``app.state``."""
    model_config = engine.model_config
    names = args.served_model_name or model_config.served_model_name or [args.model]
    # The cards' root is the model as the user named it (vLLM's), not the folder it resolved to.
    models = OpenAIServingModels([BaseModelPath(name, args.model) for name in names], model_config.max_model_len)
    chat_template = load_chat_template(args.chat_template)
    common = dict(return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                  enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                  enable_force_include_usage=args.enable_force_include_usage,
                  enable_per_request_metrics=args.enable_per_request_metrics)
    state.engine_client = engine
    state.openai_serving_models = models
    state.openai_serving_completion = OpenAIServingCompletion(engine, models, **common)
    parsers = ChatParserConfig.from_names(args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice)
    parsers.check(engine.tokenizer)
    state.openai_serving_chat = OpenAIServingChat(engine, models, response_role=args.response_role,
                                                  chat_template=chat_template, parser_config=parsers, **common)
    state.openai_serving_tokenization = OpenAIServingTokenization(engine, models, chat_template=chat_template,
                                                                  **common)
    state.server_load_metrics = 0


def create_server_socket(host: str | None, port: int) -> socket.socket:
    """Bind the listening socket before the model loads, so a busy port fails at once.

    The protocol is named: asyncio turns Nagle off (TCP_NODELAY) only on connections whose
    socket says IPPROTO_TCP, and accepted sockets inherit the listener's. With protocol 0,
    uvicorn's separate header and body writes waited on the client's delayed ACK: every
    response on a kept-alive connection after its first few came ~40 ms late.
    """
    family = socket.AF_INET6 if host and ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host or ("::" if family == socket.AF_INET6 else "0.0.0.0"), port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def run_server(args: argparse.Namespace) -> int:
    """Start the engine and serve until stopped; returns the process exit code."""
    sockets = [create_server_socket(args.host, args.port)]
    if args.metrics_port is not None:
        sockets.append(create_server_socket(args.host, args.metrics_port))
    engine_args = AsyncEngineArgs.from_cli_args(args)
    if args.reasoning_parser:
        # Structured outputs then constrain only the answer, after the reasoning (as in vLLM).
        engine_args.structured_outputs_config = {**(engine_args.structured_outputs_config or {}),
                                                 "reasoning_parser": args.reasoning_parser}
    engine = AsyncLLM.from_engine_args(engine_args, max_log_len=args.max_log_len)
    if engine.engine_core.cpu_binding is not None:
        # The engine computes on its own cores; the HTTP process keeps the others.
        bind_process(engine.engine_core.cpu_binding.api, "API server")
    exit_code = 0
    try:
        app = build_app(args)
        init_app_state(engine, app.state, args)
        freeze_gc_heap()
        config = uvicorn.Config(app, log_level=args.uvicorn_log_level, access_log=not args.disable_uvicorn_access_log,
                                ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                ssl_ca_certs=args.ssl_ca_certs, timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)

        def on_engine_dead(error: EngineDeadError) -> None:
            nonlocal exit_code
            exit_code = ENGINE_DEAD_EXIT_CODE
            logger.error("The engine is dead; the server stops in %.0f s.", ENGINE_DEAD_EXIT_DELAY_S)
            asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, setattr, server, "should_exit", True)

        engine.add_dead_listener(on_engine_dead)
        host = args.host or "0.0.0.0"
        logger.info("FastDeploy %s serving %s on http://%s:%d%s", __version__,
                    app.state.openai_serving_models.model_name, host, args.port,
                    f" (metrics on port {args.metrics_port})" if args.metrics_port else "")
        kv_config = engine.fd_config.kv_transfer_config
        if kv_config.enabled and not args.pd_comm_port:
            # The connector took a free port: that is the one to register with the router.
            args.pd_comm_port = [kv_config.port]
        # --router: register with the router once /health answers; also serves /switch_role and /role.
        hooks = InstanceHooks.from_args(args, app, apply_role=engine.switch_role)
        await hooks.start()
        try:
            await server.serve(sockets=sockets)
        finally:
            await hooks.stop()
    finally:
        engine.shutdown()
        for sock in sockets:
            sock.close()
    return exit_code


def run(args: argparse.Namespace) -> int:
    """Validate the flags and run the server; a bad flag or model ends with a message and exit code 1."""
    try:
        validate_parsed_serve_args(args)
    except ValueError as e:
        logger.error("%s", e)
        return 1
    try:
        return asyncio.run(run_server(args))
    except (ValueError, RuntimeError, OSError, TimeoutError) as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """``python -m fastdeploy.entrypoints.openai.api_server``."""
    # A SIGTERM before uvicorn installs its handlers (during model load) still stops the engine cleanly.
    signal.signal(signal.SIGTERM, _interrupt)
    args = create_parser().parse_args(argv)
    sys.exit(run(args))


if __name__ == "__main__":
    main()
