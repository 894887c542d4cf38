"""Instance side of the router: registering with it, and switching role on its request.

An API server started with ``--router URL`` registers itself once it serves (its own /health
answers 200), then re-registers every ``interval_s``: the router keeps its entry fresh and a
restarted router (or one that dropped the instance) learns it again without any operator
action. On shutdown it unregisters.

Wiring into ``fastdeploy/entrypoints/openai/api_server.py`` (``run_server``), after
``init_app_state`` and before ``server.serve``::

    hooks = InstanceHooks.from_args(args, app, apply_role=None)  # or the engine's role-switch coroutine
    await hooks.start()
    try:
        await server.serve(sockets=sockets)
    finally:
        await hooks.stop()
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from fastdeploy.distributed.kv_transfer.topology import local_host_id
from fastdeploy.logger import init_logger
from fastdeploy.router.instance import InstanceRole, normalize_protocols

logger = init_logger("fastdeploy.router.registration")


def router_base_url(router: str) -> str:
    """``host:port`` or a URL as the router's base URL."""
    url = router if router.startswith(("http://", "https://")) else f"http://{router}"
    return url.rstrip("/")


def advertised_host(bind_host: str | None, router_url: str) -> str:
    """The address the router should use for this instance.

    A wildcard bind address means "every interface", which the router cannot dial; the
    interface that routes to the router is the one it can reach us on. A UDP connect only
    picks the route, it sends no packet.
    """
    if bind_host and bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    target = httpx.URL(router_url)
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target.host, target.port or 80))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def role_from_args(args: argparse.Namespace) -> InstanceRole:
    """``--splitwise-role``, else vLLM's ``--kv-transfer-config`` kv_role, else mixed."""
    role = getattr(args, "splitwise_role", None)
    if role and role != "mixed":
        return InstanceRole.parse(role)
    kv_config = getattr(args, "kv_transfer_config", None) or {}
    if isinstance(kv_config, dict) and kv_config.get("kv_role"):
        return InstanceRole.parse(kv_config["kv_role"])
    return InstanceRole.MIXED


def instance_info_from_args(args: argparse.Namespace, router_url: str) -> dict[str, Any]:
    """The /register body of an API server started with ``args``."""
    pd_port = getattr(args, "pd_comm_port", None)
    if isinstance(pd_port, list | tuple):
        pd_port = pd_port[0] if pd_port else None
    names = getattr(args, "served_model_name", None) or [getattr(args, "model", None)]
    return {
        "role": role_from_args(args).value,
        "host": advertised_host(getattr(args, "host", None), router_url),
        "port": args.port,
        "connector_port": pd_port,
        "transfer_protocol": normalize_protocols(getattr(args, "cache_transfer_protocol", None) or "shm,tcp"),
        "host_id": local_host_id(),
        "metrics_port": getattr(args, "metrics_port", None),
        "model": names[0] if isinstance(names, list | tuple) else names,
        "tp_size": getattr(args, "tensor_parallel_size", 1) or 1,
    }


class RouterRegistration:
    """Keeps this instance registered with a router (register, refresh, unregister)."""

    def __init__(self, router_url: str, info: dict[str, Any], interval_s: float = 10.0, timeout_s: float = 5.0,
                 self_health_url: str | None = None) -> None:
        self.router_url = router_base_url(router_url)
        self.info = dict(info)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        # Registration waits until this answers 200, so the router's first probe succeeds.
        self.self_health_url = self_health_url
        self.registered = asyncio.Event()
        self.last_error: str | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Register in the background (never blocks the server's start)."""
        self._task = asyncio.create_task(self._run(), name="router-registration")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        try:
            async with self._client() as client:
                await client.post(f"{self.router_url}/unregister",
                                  json={"host": self.info["host"], "port": self.info["port"]}, timeout=2)
        except httpx.HTTPError:
            pass  # the router may be gone first; its health checks drop us anyway

    def _client(self) -> httpx.AsyncClient:
        # A client per call: registration is rare, and a role switch may call from another event loop.
        return httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)

    async def register_once(self) -> bool:
        try:
            async with self._client() as client:
                resp = await client.post(f"{self.router_url}/register", json=self.info)
        except httpx.HTTPError as e:
            self._note_failure(f"{type(e).__name__}: {e}")
            return False
        if resp.status_code != 200:
            self._note_failure(f"HTTP {resp.status_code}: {resp.text[:300]}")
            return False
        if not self.registered.is_set():
            logger.info("Registered with the router at %s as a %s instance", self.router_url, self.info["role"])
        self.last_error = None
        self.registered.set()
        return True

    def _note_failure(self, error: str) -> None:
        if error != self.last_error:
            logger.warning("Cannot register with the router at %s: %s (retrying)", self.router_url, error)
        self.last_error = error

    async def _wait_until_serving(self) -> None:
        if self.self_health_url is None:
            return
        async with self._client() as client:
            while True:
                try:
                    if (await client.get(self.self_health_url, timeout=2)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)

    async def _run(self) -> None:
        await self._wait_until_serving()
        while True:
            ok = await self.register_once()
            # Retry soon while the router is unreachable; refresh at the normal pace after.
            await asyncio.sleep(self.interval_s if ok else min(self.interval_s, 2.0))


class RoleController:
    """Handles ``POST /switch_role`` on the instance: drain, switch, re-register.

    ``in_flight`` counts the requests the server is serving (the API server's
    ``app.state.server_load_metrics``); ``apply_role`` changes the engine's role (KV connector
    direction) and must only return once the engine runs with the new role.
    """

    def __init__(self, role: InstanceRole, in_flight: Callable[[], int],
                 apply_role: Callable[[str], Awaitable[None]] | None = None,
                 registration: RouterRegistration | None = None, drain_timeout_s: float = 300.0) -> None:
        self.role = role
        self.in_flight = in_flight
        self.apply_role = apply_role
        self.registration = registration
        self.drain_timeout_s = drain_timeout_s
        self._lock = asyncio.Lock()

    async def switch(self, role: str, drain_timeout_s: float | None = None) -> JSONResponse:
        try:
            new_role = InstanceRole.parse(role)
        except ValueError as e:
            return _error(str(e), 400, "BadRequestError")
        if self.apply_role is None and new_role is not self.role:
            return _error("This server cannot switch role (its engine has no role-switch support).", 501,
                          "NotImplementedError")
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        async with self._lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while self.in_flight() > 0:
                if loop.time() > deadline:
                    return _error(f"{self.in_flight()} request(s) still in flight after {timeout:.0f} s; role "
                                  "unchanged.", 504, "GatewayTimeoutError")
                await asyncio.sleep(0.05)
            old_role = self.role
            if new_role is not old_role and self.apply_role is not None:
                try:
                    await self.apply_role(new_role.value)
                except ValueError as e:
                    return _error(str(e), 400, "BadRequestError")
            self.role = new_role
            if self.registration is not None:
                self.registration.info["role"] = new_role.value
                await self.registration.register_once()
        return JSONResponse({"status": "ok", "role": new_role.value, "previous_role": old_role.value})

    def routes(self) -> APIRouter:
        """``POST /switch_role`` ({"role": ...}) and ``GET /role`` for the API server's app."""
        api = APIRouter()

        @api.post("/switch_role")
        async def switch_role(body: dict[str, Any]) -> JSONResponse:
            return await self.switch(str(body.get("role", "")), body.get("drain_timeout"))

        @api.get("/role")
        async def current_role() -> JSONResponse:
            return JSONResponse({"role": self.role.value})

        return api


def _error(message: str, status: int, err_type: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None, "code": status}},
                        status_code=status)


class InstanceHooks:
    """Everything an API server adds for the router: the role routes and the registration task."""

    def __init__(self, controller: RoleController, registration: RouterRegistration | None) -> None:
        self.controller = controller
        self.registration = registration

    @classmethod
    def from_args(cls, args: argparse.Namespace, app: FastAPI,
                  apply_role: Callable[[str], Awaitable[None]] | None = None,
                  interval_s: float = 10.0) -> InstanceHooks:
        """Add /switch_role and /role to ``app``; register with ``args.router`` when it is set."""
        registration = None
        router = getattr(args, "router", None)
        if router:
            url = router_base_url(router)
            info = instance_info_from_args(args, url)
            bind = getattr(args, "host", None)
            local = "127.0.0.1" if not bind or bind in ("0.0.0.0", "::") else bind
            local = f"[{local}]" if ":" in local else local
            registration = RouterRegistration(url, info, interval_s=interval_s,
                                              self_health_url=f"http://{local}:{args.port}/health")
        controller = RoleController(role_from_args(args), lambda: getattr(app.state, "server_load_metrics", 0),
                                    apply_role=apply_role, registration=registration)
        app.include_router(controller.routes())
        return cls(controller, registration)

    async def start(self) -> None:
        if self.registration is not None:
            await self.registration.start()

    async def stop(self) -> None:
        if self.registration is not None:
            await self.registration.stop()
