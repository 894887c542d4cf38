"""The router: a registry of instances, health checks, load balancing and request forwarding.

Mixed instances behind the router give data parallelism: each request goes to one of them,
chosen by ``--policy``. When both prefill and decode instances are registered, a request is
served by a (prefill, decode) pair instead; see :mod:`fastdeploy.router.pd` for the protocol.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from fastdeploy.logger import init_logger
from fastdeploy.router import pd
from fastdeploy.router.errors import (
    ConnectFailed,
    NoInstanceError,
    RouterError,
    describe,
    error_response,
    failed_message,
    sse_error,
)
from fastdeploy.router.instance import InstanceInfo, InstanceRole, InstanceState
from fastdeploy.router.policies import LoadBalancePolicy, RequestFeatures, make_policy

logger = init_logger("fastdeploy.router")

# Request headers that describe the router's own connection, not the request.
_HOP_BY_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
               "upgrade", "proxy-authorization", "proxy-connection", "accept-encoding"}
# Response headers the router must not copy: it re-frames (and never re-encodes) the body.
_RESPONSE_DROP = {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive", "date",
                  "server"}


@dataclass
class RouterArgs:
    """Settings of the router (``fastdeploy router`` flags)."""

    host: str = "0.0.0.0"
    port: int = 9000
    policy: str = "request_num"
    # Per-role policies in PD mode; None means ``policy``.
    prefill_policy: str | None = None
    decode_policy: str | None = None
    # How a (prefill, decode) pair is driven: "sequential" (vLLM's proxy) or "concurrent" (FastDeploy's).
    pd_protocol: str = pd.SEQUENTIAL
    # Accepted for FastDeploy launch scripts: PD pairing is automatic once both roles register.
    splitwise: bool = False
    health_check_interval: float = 5.0
    health_check_timeout: float = 5.0
    # Failed checks in a row before an instance stops getting work.
    health_failure_threshold: int = 2
    # An instance that stays unhealthy this long is dropped from the table (it may re-register).
    unhealthy_removal_s: float = 600.0
    request_timeout: float = 1800.0
    connect_timeout: float = 10.0
    # Other instances tried when one refuses the connection (nothing was sent, so it is safe).
    connect_retries: int = 1
    # Instances given on the command line rather than registered: "host:port".
    instances: list[str] = field(default_factory=list)
    prefill_instances: list[str] = field(default_factory=list)
    decode_instances: list[str] = field(default_factory=list)
    # cache_aware tuning.
    cache_block_chars: int = 64
    cache_max_prefix_chars: int = 4096
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 8
    balance_rel_threshold: float = 1.5
    uvicorn_log_level: str = "info"

    def policy_options(self) -> dict[str, Any]:
        return {"block_chars": self.cache_block_chars, "max_prefix_chars": self.cache_max_prefix_chars,
                "cache_threshold": self.cache_threshold,
                "balance_abs_threshold": self.balance_abs_threshold,
                "balance_rel_threshold": self.balance_rel_threshold}

    def validate(self) -> None:
        for name in (self.policy, self.prefill_policy, self.decode_policy):
            if name is not None:
                make_policy(name)
        if self.pd_protocol not in pd.PROTOCOLS:
            raise ValueError(f"Unknown --pd-protocol {self.pd_protocol!r}; choose one of {', '.join(pd.PROTOCOLS)}.")
        if self.health_check_interval <= 0 or self.health_check_timeout <= 0:
            raise ValueError("--health-check-interval and --health-check-timeout must be positive.")
        if self.health_failure_threshold < 1:
            raise ValueError("--health-failure-threshold must be at least 1.")


class _Lease:
    """One request's share of an instance's load; released exactly once."""

    def __init__(self, router: Router, instance: InstanceState, tokens: int) -> None:
        self.router = router
        self.instance = instance
        self.tokens = tokens
        self.released = False
        instance.in_flight += 1
        instance.in_flight_tokens += tokens
        instance.total_requests += 1
        router.metrics.requests.labels(instance.id, instance.role.value).inc()

    def release(self, failed: bool = False) -> None:
        if self.released:
            return
        self.released = True
        self.instance.in_flight -= 1
        self.instance.in_flight_tokens -= self.tokens
        if failed:
            self.instance.failed_requests += 1
            self.router.metrics.failures.labels(self.instance.id, self.instance.role.value).inc()


class RouterMetrics:
    """The router's own Prometheus figures (``fastdeploy:router_*``), in a registry of its own."""

    def __init__(self, router: Router) -> None:
        self.registry = CollectorRegistry()
        labels = ["instance", "role"]
        self.requests = Counter("fastdeploy:router_requests", "Requests the router sent to an instance.", labels,
                                registry=self.registry)
        self.failures = Counter("fastdeploy:router_request_failures",
                                "Requests that failed at the instance (connection lost, refused, timed out).",
                                labels, registry=self.registry)
        self.prefill_seconds = Histogram(
            "fastdeploy:router_pd_prefill_seconds", "Prefill phase of a PD request, as the router sees it.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)
        healthy = Gauge("fastdeploy:router_healthy_instances", "Instances that receive work, by role.", ["role"],
                        registry=self.registry)
        in_flight = Gauge("fastdeploy:router_in_flight_requests", "Requests in flight, by role.", ["role"],
                          registry=self.registry)
        for role in InstanceRole:
            healthy.labels(role.value).set_function(
                lambda r=role: sum(1 for s in router.instances.values() if s.role is r and s.available))
            in_flight.labels(role.value).set_function(
                lambda r=role: sum(s.in_flight for s in router.instances.values() if s.role is r))


class Router:
    """Holds the instances and routes requests to them (one event loop; no locks needed).

    Selection and load accounting run without an ``await`` in between, so concurrent requests
    on the loop always see each other's load.
    """

    def __init__(self, args: RouterArgs) -> None:
        args.validate()
        self.args = args
        self.instances: dict[str, InstanceState] = {}
        options = args.policy_options()
        self.policies: dict[InstanceRole, LoadBalancePolicy] = {
            InstanceRole.MIXED: make_policy(args.policy, **options),
            InstanceRole.PREFILL: make_policy(args.prefill_policy or args.policy, **options),
            InstanceRole.DECODE: make_policy(args.decode_policy or args.policy, **options),
        }
        self.metrics = RouterMetrics(self)
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None

    # ---- life cycle --------------------------------------------------------------------------
    async def start(self) -> None:
        # trust_env=False: a proxy set in the environment must never sit between router and instances.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.args.request_timeout, connect=self.args.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256), trust_env=False)
        for role, addresses in ((InstanceRole.MIXED, self.args.instances),
                                (InstanceRole.PREFILL, self.args.prefill_instances),
                                (InstanceRole.DECODE, self.args.decode_instances)):
            for address in addresses:
                await self.register(_static_instance(address, role))
        self._health_task = asyncio.create_task(self._health_loop(), name="router-health-checks")

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except asyncio.CancelledError:
                pass
        if self.client is not None:
            await self.client.aclose()

    # ---- registry ----------------------------------------------------------------------------
    async def register(self, data: dict[str, Any]) -> InstanceState:
        """Add or update an instance; probed at once so a dead address never gets work."""
        info = InstanceInfo.from_dict(data)
        state = self.instances.get(info.id)
        if state is None:
            state = InstanceState(info=info)
            self.instances[info.id] = state
            logger.info("Registered %s instance %s", info.role.value, info.id)
        else:
            if state.info.role is not info.role:
                # Its cached prefixes belong to the old role's pool now.
                self.policies[state.info.role].forget(info.id)
            state.info = info
            state.registered_at = time.time()
            logger.info("Re-registered %s instance %s", info.role.value, info.id)
        if info.role is not InstanceRole.MIXED and info.connector_port is None:
            logger.warning("%s instance %s registered without a connector port (--pd-comm-port).",
                           info.role.value, info.id)
        await self._check(state)
        return state

    def unregister(self, instance_id: str) -> InstanceState | None:
        state = self.instances.pop(instance_id, None)
        if state is not None:
            self.policies[state.role].forget(instance_id)
            logger.info("Unregistered %s instance %s", state.role.value, instance_id)
        return state

    def candidates(self, role: InstanceRole) -> list[InstanceState]:
        return [s for s in self.instances.values() if s.role is role and s.available]

    def pd_ready(self) -> bool:
        return bool(self.candidates(InstanceRole.PREFILL)) and bool(self.candidates(InstanceRole.DECODE))

    def pick(self, role: InstanceRole, features: RequestFeatures, exclude: set[str] | None = None) -> InstanceState:
        """Choose an instance of ``role`` with that role's policy."""
        candidates = [c for c in self.candidates(role) if not exclude or c.id not in exclude]
        if not candidates:
            counts = {r.value: sum(1 for s in self.instances.values() if s.role is r) for r in InstanceRole}
            raise NoInstanceError(f"No healthy {role.value} instance available (registered: "
                                  f"{', '.join(f'{k}={v}' for k, v in counts.items())}).")
        policy = self.policies[role]
        chosen = policy.select(candidates, features)
        policy.on_routed(chosen, features)
        return chosen

    # ---- health ------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.args.health_check_interval)
            try:
                await self.check_all()
            except Exception:  # the loop must outlive any one bad round
                logger.exception("Health-check round failed")

    async def check_all(self) -> None:
        """Probe every instance once; drop those unhealthy for longer than the removal delay."""
        states = list(self.instances.values())
        await asyncio.gather(*(self._check(s) for s in states))
        now = time.monotonic()
        for state in states:
            if (not state.healthy and state.unhealthy_since is not None
                    and now - state.unhealthy_since > self.args.unhealthy_removal_s
                    and self.instances.get(state.id) is state):
                logger.warning("Removing %s: unhealthy for %.0f s", state.id, now - state.unhealthy_since)
                self.unregister(state.id)

    async def _check(self, state: InstanceState) -> bool:
        assert self.client is not None
        timeout = self.args.health_check_timeout
        state.last_check = time.time()
        try:
            resp = await self.client.get(f"{state.info.url}/health", timeout=timeout)
            ok = resp.status_code == 200
            error = None if ok else f"/health answered {resp.status_code}"
        except httpx.HTTPError as e:
            ok, error = False, f"/health failed: {describe(e)}"
        if ok:
            if not state.healthy:
                logger.info("Instance %s is healthy again", state.id)
            state.mark_healthy()
            await self._poll_load(state)
        elif state.mark_failure(error or "unhealthy", self.args.health_failure_threshold):
            logger.warning("Instance %s is unhealthy and gets no work: %s", state.id, error)
        return ok

    async def _poll_load(self, state: InstanceState) -> None:
        """The instance's own /load figure, shown in /instances (best effort: older servers lack it)."""
        assert self.client is not None
        try:
            resp = await self.client.get(f"{state.info.url}/load", timeout=self.args.health_check_timeout)
            if resp.status_code == 200:
                state.reported_load = int(resp.json().get("server_load"))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            pass

    def fail_instance(self, state: InstanceState, error: str) -> None:
        """A request found the instance dead: stop sending it work until a health check passes."""
        if state.healthy:
            logger.warning("Instance %s failed a request and gets no work until healthy: %s", state.id, error)
        state.healthy = False
        state.consecutive_failures += 1
        state.last_error = error
        if state.unhealthy_since is None:
            state.unhealthy_since = time.monotonic()

    # ---- forwarding --------------------------------------------------------------------------
    async def handle(self, endpoint: str, body: dict[str, Any], headers: dict[str, str]) -> Response:
        """Serve one /v1 completion request: through a PD pair when one exists, else a mixed instance."""
        features = RequestFeatures.from_body(body)
        try:
            if self.pd_ready() and (pd.pd_supported(body) or not self.candidates(InstanceRole.MIXED)):
                return await pd.handle_pd(self, endpoint, body, headers, features)
            return await self.forward(InstanceRole.MIXED, endpoint, body, headers, features)
        except RouterError as e:
            return error_response(e.message, e.status, e.err_type)

    async def forward(self, role: InstanceRole, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                      features: RequestFeatures, retries: int | None = None,
                      on_stream_error: Callable[[], Awaitable[None]] | None = None) -> Response:
        """Send the request to an instance of ``role`` and relay its answer (streamed or not).

        A refused connection is retried on another instance; any later failure is the client's
        error, since part of the answer may already have been generated.
        """
        tried: set[str] = set()
        retries = self.args.connect_retries if retries is None else retries
        while True:
            instance = self.pick(role, features, exclude=tried)
            tried.add(instance.id)
            try:
                return await self.proxy(instance, endpoint, body, headers, features, on_stream_error)
            except ConnectFailed as e:
                if len(tried) > retries:
                    raise RouterError(str(e), 502) from None
                logger.warning("%s; trying another %s instance", e, role.value)

    async def proxy(self, instance: InstanceState, endpoint: str, body: dict[str, Any], headers: dict[str, str],
                    features: RequestFeatures, on_stream_error: Callable[[], Awaitable[None]] | None = None,
                    lease: _Lease | None = None, guard: asyncio.Task | None = None) -> Response:
        """Relay one request to ``instance``: JSON as is, SSE chunk by chunk, errors with their status.

        ``lease`` is the load already booked on the instance (else one is taken here). ``guard`` is
        a task that runs alongside (the prefill half of a concurrent PD request): if it fails
        first, the request to ``instance`` is abandoned and the guard's error is the answer.
        """
        lease = lease or self.lease(instance, features)
        try:
            resp = await race(self.open(instance, endpoint, body, headers), guard)
        except BaseException:
            lease.release(failed=True)
            raise
        if not _is_event_stream(resp):
            try:
                content = await race(resp.aread(), guard)
            except httpx.HTTPError as e:
                lease.release(failed=True)
                self.fail_instance(instance, describe(e))
                raise RouterError(failed_message(instance, e)) from None
            except BaseException:
                lease.release(failed=True)
                raise
            finally:
                await resp.aclose()
            lease.release()
            return Response(content=content, status_code=resp.status_code, headers=_response_headers(resp))
        return StreamingResponse(self._relay(instance, resp, lease, on_stream_error, guard),
                                 status_code=resp.status_code, headers=_response_headers(resp))

    def lease(self, instance: InstanceState, features: RequestFeatures) -> _Lease:
        """Book a request's load on ``instance`` (released when its answer is done)."""
        return _Lease(self, instance, features.num_prompt_tokens)

    async def open(self, instance: InstanceState, endpoint: str, body: dict[str, Any],
                   headers: dict[str, str]) -> httpx.Response:
        """POST to the instance and return once its response headers are in (the body is unread)."""
        assert self.client is not None
        request = self.client.build_request("POST", f"{instance.info.url}/{endpoint.lstrip('/')}",
                                            json=body, headers=headers)
        try:
            return await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.fail_instance(instance, describe(e))
            raise ConnectFailed(f"Cannot connect to {instance.role.value} instance {instance.id}: "
                                 f"{describe(e)}") from None
        except httpx.TimeoutException as e:
            raise RouterError(f"{instance.role.value.capitalize()} instance {instance.id} did not answer within "
                              f"{self.args.request_timeout:.0f} s.", 504, "GatewayTimeoutError") from e
        except httpx.HTTPError as e:
            self.fail_instance(instance, describe(e))
            raise RouterError(failed_message(instance, e)) from None

    async def _relay(self, instance: InstanceState, resp: httpx.Response, lease: _Lease,
                     on_stream_error: Callable[[], Awaitable[None]] | None,
                     guard: asyncio.Task | None) -> AsyncIterator[bytes]:
        """Pass the instance's SSE bytes through as they arrive; a broken stream ends with an error event."""
        failed = False
        chunks = resp.aiter_bytes()
        try:
            while True:
                try:
                    chunk = await race(anext(chunks), guard)
                except StopAsyncIteration:
                    break
                yield chunk
        except httpx.HTTPError as e:
            failed = True
            if not isinstance(e, httpx.TimeoutException):
                self.fail_instance(instance, describe(e))
            logger.warning("%s", failed_message(instance, e))
            if on_stream_error is not None:
                await on_stream_error()
            yield sse_error(failed_message(instance, e))
        except RouterError as e:
            # The guard (prefill half) failed: the decode side can never get its KV cache.
            failed = True
            yield sse_error(e.message, e.status, e.err_type)
        finally:
            # Closing the upstream response on a client disconnect makes the instance abort the request.
            await resp.aclose()
            lease.release(failed=failed)

    async def models(self, headers: dict[str, str]) -> Response:
        """GET /v1/models from any healthy instance (they all serve the same model)."""
        assert self.client is not None
        for role in (InstanceRole.MIXED, InstanceRole.DECODE, InstanceRole.PREFILL):
            for instance in self.candidates(role):
                try:
                    resp = await self.client.get(f"{instance.info.url}/v1/models", headers=headers,
                                                 timeout=self.args.health_check_timeout)
                except httpx.HTTPError as e:
                    self.fail_instance(instance, describe(e))
                    continue
                return Response(content=resp.content, status_code=resp.status_code, headers=_response_headers(resp))
        return error_response("No healthy instance available to list the models.", 503, "ServiceUnavailableError")

    # ---- role switching ----------------------------------------------------------------------
    async def switch_role(self, instance_id: str, role: str, drain_timeout_s: float = 300.0) -> Response:
        """Drain ``instance_id`` of the router's work, ask it to change role, then route by the new role.

        The instance gets no new work while draining; its in-flight requests finish normally, so
        no request is lost. The instance answers ``POST /switch_role`` once it has drained what
        it serves for others too and switched; only then does the router use the new role.
        """
        state = self.instances.get(instance_id)
        if state is None:
            return error_response(f"Instance {instance_id} is not registered.", 404, "NotFoundError")
        try:
            new_role = InstanceRole.parse(role)
        except ValueError as e:
            return error_response(str(e), 400, "BadRequestError")
        assert self.client is not None
        state.draining = True
        started = time.monotonic()
        try:
            while state.in_flight > 0:
                if time.monotonic() - started > drain_timeout_s:
                    return error_response(f"Instance {instance_id} still has {state.in_flight} request(s) in "
                                          f"flight after {drain_timeout_s:.0f} s; role unchanged.", 504,
                                          "GatewayTimeoutError")
                await asyncio.sleep(0.05)
            remaining = max(1.0, drain_timeout_s - (time.monotonic() - started))
            try:
                resp = await self.client.post(f"{state.info.url}/switch_role", json={"role": new_role.value},
                                              timeout=remaining)
            except httpx.HTTPError as e:
                return error_response(f"Instance {instance_id} did not switch role: {describe(e)}", 502,
                                      "BadGatewayError")
            if resp.status_code != 200:
                return Response(content=resp.content, status_code=resp.status_code, headers=_response_headers(resp))
            old_role = state.role
            self.policies[old_role].forget(instance_id)
            state.info.role = new_role
            logger.info("Instance %s switched role %s -> %s in %.2f s", instance_id, old_role.value, new_role.value,
                        time.monotonic() - started)
            return JSONResponse({"status": "ok", "instance": state.to_dict(), "previous_role": old_role.value,
                                 "seconds": round(time.monotonic() - started, 3)})
        finally:
            state.draining = False


async def race(awaitable: Awaitable[Any], guard: asyncio.Task | None) -> Any:
    """Await ``awaitable`` unless ``guard`` fails first; then cancel it and raise the guard's error.

    A guard that finishes successfully stops mattering; the awaitable is then awaited alone.
    """
    if guard is None or (guard.done() and not guard.cancelled() and guard.exception() is None):
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            if guard.done():
                if guard.cancelled() or guard.exception() is not None:
                    task.cancel()
                    guard.result()  # raises the guard's error (or CancelledError)
                return await task
            await asyncio.wait({task, guard}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
    except BaseException:
        task.cancel()
        raise


def _static_instance(address: str, role: InstanceRole) -> dict[str, Any]:
    """``host:port`` (optionally ``http://``) from the command line as a registration body."""
    text = address.removeprefix("http://").rstrip("/")
    host, _, port = text.rpartition(":")
    if not host or not port:
        raise ValueError(f"Instance address {address!r} must be host:port.")
    return {"role": role.value, "host": host.strip("[]"), "port": port}


def _is_event_stream(resp: httpx.Response) -> bool:
    return resp.status_code == 200 and resp.headers.get("content-type", "").startswith("text/event-stream")


def _response_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _RESPONSE_DROP}


def forward_headers(headers: Any) -> dict[str, str]:
    """The client's headers minus those about its connection to the router."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
