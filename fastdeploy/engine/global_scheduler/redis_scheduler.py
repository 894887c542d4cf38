"""``--scheduler-name global``: instances share request queues and a load table in Redis.

Each instance (``name``) has, under ``fd:sched:<topic>:``,

- ``req:<name>``   a list: requests submitted to it and not yet taken by any instance;
- ``res:<name>``   a list: results for its requests that other instances computed;
- ``alive:<name>`` a key that expires unless its heartbeat refreshes it;
- ``load``         a sorted set shared by all: instance -> its load (running + waiting);
- ``abort:<name>:<request_id>`` set when the instance's caller gave up on a request that may run elsewhere.

An instance takes work from its own queue first. When that is empty it steals from the
most loaded live instances' queues (the list pop is atomic, so no request runs twice), runs
the request and sends the results to the submitting instance's result list, from which the
submitter streams them to its client. Instances that stop beating are dropped from the load
table and their queues deleted (nobody is left to answer those clients). Every key carries
a TTL, so an abandoned topic cleans itself up.

Redis unreachable is a :class:`SchedulerConnectionError` (a ``ConnectionError`` naming
``host:port``), raised within the socket timeouts: never a hang.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from fastdeploy.logger import init_logger

logger = init_logger("fastdeploy.engine.global_scheduler")

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class SchedulerConnectionError(ConnectionError):
    """The global scheduler's Redis cannot be reached (the message names host:port)."""


@dataclass
class GlobalSchedulerConfig:
    """Settings of the global scheduler (``--scheduler-*`` flags)."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    password: str | None = None
    topic: str = "default"
    # Lifetime of queues and result lists nobody touches (seconds).
    ttl: int = 900
    # This instance's name in the load table (default: hostname:pid:random).
    instance_name: str | None = None
    heartbeat_interval_s: float = 2.0
    # An instance whose heartbeat is older than this is considered dead.
    instance_expiry_s: float = 10.0
    socket_timeout_s: float = 5.0
    connect_timeout_s: float = 3.0
    # Steal only from instances with at least this many queued requests, at most this many at once.
    steal_min_queue: int = 1
    max_steal: int = 8

    @classmethod
    def from_args(cls, args: Any) -> GlobalSchedulerConfig:
        """From parsed CLI flags (``scheduler_host``, ``scheduler_port``, ``scheduler_topic``, ...)."""
        config = cls()
        for name in ("host", "port", "db", "password", "topic", "ttl"):
            value = getattr(args, f"scheduler_{name}", None)
            if value is not None:
                setattr(config, name, value)
        return config


@dataclass
class ScheduledRequest:
    """A request in the shared queue: an opaque msgpack-able payload and where it came from."""

    request_id: str
    payload: Any
    origin: str = ""
    num_prompt_tokens: int = 0
    enqueued_at: float = field(default_factory=time.time)


@dataclass
class ScheduledResult:
    """One output of a request (a chunk of tokens or the final answer) on its way to the origin."""

    request_id: str
    payload: Any
    finished: bool = False


class GlobalScheduler:
    """The Redis-backed request queue and load table of one instance."""

    def __init__(self, config: GlobalSchedulerConfig | None = None, **overrides: Any) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.config = config or GlobalSchedulerConfig()
        for key, value in overrides.items():
            setattr(self.config, key, value)
        cfg = self.config
        self.name = cfg.instance_name or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._prefix = f"fd:sched:{cfg.topic}:"
        # No client-side retries: a dead Redis must surface as an error now, not after backoffs.
        self._redis = redis.Redis(host=cfg.host, port=cfg.port, db=cfg.db, password=cfg.password,
                                  socket_timeout=cfg.socket_timeout_s, socket_connect_timeout=cfg.connect_timeout_s,
                                  retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._redis_errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._lock = threading.Lock()
        # Requests this instance submitted and still waits for: request_id -> submitted time.
        self._pending: dict[str, float] = {}
        # Requests this instance took from another instance: request_id -> origin instance.
        self._stolen: dict[str, str] = {}
        self._local_results: dict[str, list[ScheduledResult]] = defaultdict(list)
        self._load = 0
        self.last_error: str | None = None
        self._call(self._redis.ping)  # fail fast when Redis is not there
        self._closed = threading.Event()
        self._beat()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="global-scheduler-heartbeat",
                                           daemon=True)
        self._heartbeat.start()
        logger.info("Global scheduler %s on redis://%s:%d topic %r", self.name, cfg.host, cfg.port, cfg.topic)

    # ---- keys --------------------------------------------------------------------------------
    def _key(self, kind: str, name: str | None = None) -> str:
        return f"{self._prefix}{kind}" if name is None else f"{self._prefix}{kind}:{name}"

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a Redis command; an unreachable server becomes a SchedulerConnectionError."""
        try:
            return fn(*args, **kwargs)
        except self._redis_errors as e:
            message = (f"Global scheduler cannot reach Redis at {self.config.host}:{self.config.port} "
                       f"(topic {self.config.topic!r}): {e}")
            self.last_error = message
            raise SchedulerConnectionError(message) from e

    # ---- heartbeat and membership ----------------------------------------------------------
    def _beat(self) -> None:
        cfg = self.config
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._key("alive", self.name), str(time.time()), px=int(cfg.instance_expiry_s * 1000))
        pipe.zadd(self._key("load"), {self.name: self._load})
        pipe.expire(self._key("load"), cfg.ttl)
        self._call(pipe.execute)

    def _heartbeat_loop(self) -> None:
        failing = False
        while not self._closed.wait(self.config.heartbeat_interval_s):
            try:
                self._beat()
                self._drop_dead_instances()
            except SchedulerConnectionError as e:
                if not failing:  # once per outage, not every beat
                    logger.error("Global scheduler heartbeat failed: %s", e)
                failing = True
                continue
            if failing:
                logger.info("Global scheduler heartbeat restored.")
            failing = False
            self.last_error = None

    def _drop_dead_instances(self) -> None:
        """Forget instances whose heartbeat expired: their queued requests have no one to answer to."""
        names = [n.decode() for n in self._call(self._redis.zrange, self._key("load"), 0, -1)]
        others = [n for n in names if n != self.name]
        if not others:
            return
        alive = self._call(self._redis.mget, [self._key("alive", n) for n in others])
        for name, beat in zip(others, alive, strict=True):
            if beat is None:
                logger.warning("Instance %s stopped beating; dropping it and its queue", name)
                pipe = self._redis.pipeline(transaction=False)
                pipe.zrem(self._key("load"), name)
                pipe.delete(self._key("req", name), self._key("res", name))
                self._call(pipe.execute)

    def alive_instances(self) -> dict[str, float]:
        """Live instances of the topic and their reported loads."""
        entries = [(n.decode(), score) for n, score in
                   self._call(self._redis.zrange, self._key("load"), 0, -1, withscores=True)]
        if not entries:
            return {}
        beats = self._call(self._redis.mget, [self._key("alive", n) for n, _ in entries])
        return {n: score for (n, score), beat in zip(entries, beats, strict=True) if beat is not None}

    def report_load(self, load: int) -> None:
        """This instance's load (running + waiting requests), used by others to decide whom to steal from."""
        self._load = int(load)
        self._call(self._redis.zadd, self._key("load"), {self.name: self._load})

    # ---- requests ----------------------------------------------------------------------------
    def put_requests(self, requests: list[ScheduledRequest]) -> list[tuple[str, str | None]]:
        """Queue requests submitted to this instance; (request_id, error or None) for each."""
        accepted, outcome = [], []
        with self._lock:
            for request in requests:
                if request.request_id in self._pending:
                    outcome.append((request.request_id, "duplicate request_id"))
                    continue
                request.origin = self.name
                self._pending[request.request_id] = time.time()
                accepted.append(request)
                outcome.append((request.request_id, None))
        if accepted:
            key = self._key("req", self.name)
            pipe = self._redis.pipeline(transaction=False)
            pipe.rpush(key, *[_encode(dataclasses.asdict(r)) for r in accepted])
            pipe.expire(key, self.config.ttl)
            try:
                self._call(pipe.execute)
            except SchedulerConnectionError:
                with self._lock:
                    for request in accepted:
                        self._pending.pop(request.request_id, None)
                raise
        return outcome

    def get_requests(self, max_num: int = 1, block_s: float = 0.0) -> list[ScheduledRequest]:
        """Up to ``max_num`` requests to run here: own queue first, else stolen from the busiest.

        ``block_s`` > 0 waits that long for one to appear (bounded below the socket timeout).
        """
        if max_num < 1:
            return []
        own = self._key("req", self.name)
        raw = self._call(self._redis.lpop, own, max_num) or []
        if not raw:
            raw = self._steal(max_num)
        if not raw and block_s > 0:
            queues = [own] + [self._key("req", n) for n in self._victims()]
            wait = min(block_s, max(0.1, self.config.socket_timeout_s - 1.0))
            popped = self._call(self._redis.blpop, queues, timeout=wait)
            raw = [popped[1]] if popped else []
        requests = [ScheduledRequest(**_decode(item)) for item in raw]
        with self._lock:
            for request in requests:
                if request.origin != self.name:
                    self._stolen[request.request_id] = request.origin
        return requests

    def _victims(self) -> list[str]:
        """Other live instances, most loaded first."""
        entries = self._call(self._redis.zrevrange, self._key("load"), 0, -1, withscores=True)
        names = [n.decode() for n, _ in entries if n.decode() != self.name]
        if not names:
            return []
        beats = self._call(self._redis.mget, [self._key("alive", n) for n in names])
        return [n for n, beat in zip(names, beats, strict=True) if beat is not None]

    def _steal(self, max_num: int) -> list[bytes]:
        for victim in self._victims():
            key = self._key("req", victim)
            queued = self._call(self._redis.llen, key)
            if queued < self.config.steal_min_queue:
                continue
            # Take up to half of the victim's backlog: it keeps working on the rest.
            count = min(max_num, self.config.max_steal, max(1, queued // 2))
            # Beat first: the victim checks that whoever runs its request is alive, and after Redis
            # restarts empty this instance would be unknown until its next heartbeat.
            self._beat()
            raw = self._call(self._redis.lpop, key, count)
            if raw:
                logger.debug("Instance %s took %d request(s) from %s", self.name, len(raw), victim)
                return raw
        return []

    # ---- results -----------------------------------------------------------------------------
    def put_results(self, results: list[ScheduledResult]) -> None:
        """Results of requests run here: to the local caller, or to the submitting instance."""
        remote: dict[str, list[bytes]] = defaultdict(list)
        delivered: list[str] = []
        with self._lock:
            for result in results:
                origin = self._stolen.get(result.request_id)
                if origin is None:
                    self._local_results[result.request_id].append(result)
                else:
                    remote[origin].append(_encode(dataclasses.asdict(result)))
                    if result.finished:
                        delivered.append(result.request_id)
        if remote:
            pipe = self._redis.pipeline(transaction=False)
            for origin, items in remote.items():
                key = self._key("res", origin)
                pipe.rpush(key, *items)
                pipe.expire(key, self.config.ttl)
            self._call(pipe.execute)
        # Forgotten only once sent: a caller may retry a final result Redis did not take.
        with self._lock:
            for request_id in delivered:
                self._stolen.pop(request_id, None)

    def get_results(self, timeout_s: float = 0.0) -> dict[str, list[ScheduledResult]]:
        """Results for requests submitted here (computed here or elsewhere), by request id."""
        key = self._key("res", self.name)
        raw = self._call(self._redis.lpop, key, 1000) or []
        with self._lock:
            have_local = bool(self._local_results)
        if not raw and not have_local and timeout_s > 0:
            wait = min(timeout_s, max(0.1, self.config.socket_timeout_s - 1.0))
            popped = self._call(self._redis.blpop, [key], timeout=wait)
            raw = [popped[1]] if popped else []
        out: dict[str, list[ScheduledResult]] = defaultdict(list)
        with self._lock:
            for request_id, items in self._local_results.items():
                out[request_id].extend(items)
            self._local_results.clear()
            for item in raw:
                result = ScheduledResult(**_decode(item))
                out[result.request_id].append(result)
            for request_id, items in out.items():
                if any(r.finished for r in items):
                    self._pending.pop(request_id, None)
        return dict(out)

    # ---- aborts -------------------------------------------------------------------------------
    def abort(self, request_ids: list[str]) -> None:
        """Mark requests submitted here as aborted by their caller: whoever takes or runs them drops them."""
        if not request_ids:
            return
        self.forget(request_ids)
        pipe = self._redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.set(self._key("abort", f"{self.name}:{request_id}"), 1, ex=self.config.ttl)
        self._call(pipe.execute)

    def aborted(self, origins: dict[str, str]) -> set[str]:
        """Which of these requests (request_id -> origin instance) their origin aborted."""
        if not origins:
            return set()
        ids = list(origins)
        marks = self._call(self._redis.mget, [self._key("abort", f"{origins[i]}:{i}") for i in ids])
        return {request_id for request_id, mark in zip(ids, marks, strict=True) if mark is not None}

    def forget(self, request_ids: list[str]) -> None:
        """Drop the bookkeeping of requests that ended outside ``put_results``/``get_results``.

        E.g. requests submitted here that ran here (their outputs never crossed Redis), failed or
        were aborted, and stolen requests whose origin gave up on them.
        """
        with self._lock:
            for request_id in request_ids:
                self._pending.pop(request_id, None)
                self._stolen.pop(request_id, None)
                self._local_results.pop(request_id, None)

    def pending(self) -> int:
        """Requests submitted here whose final result has not arrived yet."""
        with self._lock:
            return len(self._pending)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop beating and leave the topic (own queue deleted: its clients are gone with us)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._heartbeat.join(5)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(self._key("alive", self.name), self._key("req", self.name))
            pipe.zrem(self._key("load"), self.name)
            self._call(pipe.execute)
        except SchedulerConnectionError as e:
            logger.warning("Leaving the global scheduler: %s", e)
        finally:
            self._redis.close()

    def __enter__(self) -> GlobalScheduler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
