"""The router's HTTP API (FastAPI).

Instances: ``POST /register``, ``POST /unregister``, ``GET /instances``,
``GET /registered_number`` (FastDeploy's), ``POST /switch_role``.
Clients: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (the router's own ``fastdeploy:router_*`` figures).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fastdeploy.logger import init_logger
from fastdeploy.router.errors import error_response
from fastdeploy.router.instance import InstanceRole
from fastdeploy.router.router import Router, RouterArgs, forward_headers

logger = init_logger("fastdeploy.router.launch")


async def _json_body(request: Request) -> dict[str, Any] | JSONResponse:
    """The request's JSON object, or the 400 error to answer with."""
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as e:
        return error_response(f"Request body is not valid JSON: {e}", 400, "BadRequestError")
    if not isinstance(body, dict):
        return error_response("Request body must be a JSON object.", 400, "BadRequestError")
    return body


def build_app(router: Router) -> FastAPI:
    """The app serving ``router``; the router's client and health checks live with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="FastDeploy router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.post("/register")
    async def register(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            state = await router.register(body)
        except ValueError as e:
            return error_response(str(e), 400, "BadRequestError")
        return JSONResponse({"status": "ok", "instance": state.to_dict()})

    @app.post("/unregister")
    async def unregister(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        instance_id = body.get("id") or _address(body)
        if router.unregister(str(instance_id)) is None:
            return error_response(f"Instance {instance_id} is not registered.", 404, "NotFoundError")
        return JSONResponse({"status": "ok"})

    @app.get("/instances")
    async def instances(role: str | None = None) -> Response:
        states = list(router.instances.values())
        if role is not None:
            try:
                wanted = InstanceRole.parse(role)
            except ValueError as e:
                return error_response(str(e), 400, "BadRequestError")
            states = [s for s in states if s.role is wanted]
        return JSONResponse({"instances": [s.to_dict() for s in states],
                             "policy": {r.value: p.name for r, p in router.policies.items()},
                             "pd_protocol": router.args.pd_protocol})

    @app.get("/registered_number")
    async def registered_number() -> Response:
        return JSONResponse({r.value: sum(1 for s in router.instances.values() if s.role is r) for r in InstanceRole})

    @app.post("/switch_role")
    async def switch_role(request: Request) -> Response:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        instance_id = body.get("id") or body.get("instance") or _address(body)
        if not instance_id or "role" not in body:
            return error_response("switch_role needs the instance (id or host and port) and the new role.", 400,
                                  "BadRequestError")
        return await router.switch_role(str(instance_id), str(body["role"]),
                                        float(body.get("drain_timeout", 300.0)))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(forward_headers(request.headers))

    async def completion(request: Request, endpoint: str) -> Response:
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        return await router.handle(endpoint, body, forward_headers(request.headers))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await completion(request, "v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await completion(request, "v1/chat/completions")

    return app


def _address(body: dict[str, Any]) -> str | None:
    host = body.get("host") or body.get("host_ip")
    port = body.get("port")
    return f"{host}:{port}" if host and port else None


def run_router(args: RouterArgs) -> int:
    """Serve the router on ``args.host:args.port`` until interrupted; returns the exit code."""
    router = Router(args)
    app = build_app(router)
    logger.info("FastDeploy router on http://%s:%d (policy %s, PD protocol %s)", args.host, args.port, args.policy,
                args.pd_protocol)
    import uvicorn

    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                    timeout_graceful_shutdown=5)
    except KeyboardInterrupt:
        pass
    except OSError as e:
        logger.error("%s", e)
        return 1
    return 0
