"""The engine core's side of ``--scheduler-name global``: a thread between the core loop and Redis.

With the global scheduler, a request the API process submits is not run at once: the core loop
hands it to this bridge, which queues it in Redis (:class:`GlobalScheduler`). The bridge takes
work back from Redis whenever the local core has room (its own queue first, else stolen from the
busiest instance) and hands it to the loop as ordinary requests, so an idle instance takes work
from a busy one. Outputs of a stolen request go through Redis to the instance that received it;
that instance's bridge pushes them to its API process exactly as the core pushes its own outputs.
Outputs of a request run where it was submitted go straight to the API, as without the bridge.

Threads: the core loop talks to the bridge thread over an inproc PAIR socket
(:class:`CoreEndpoint` is the loop's end); every Redis call happens on the bridge thread, never on
the loop's hot path.

Failures never leave a caller waiting: when Redis cannot be reached, every request of this instance
that is not running here fails at once with the :class:`SchedulerConnectionError` message (which
names host:port), stolen requests stop here and their origin is told as soon as Redis answers
again; requests of this instance taken by an instance whose heartbeat stopped fail too. The engine
keeps serving and works again when Redis is back.
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from fastdeploy.config import FDConfig
from fastdeploy.engine.core_messages import (
    EngineCoreOutputType,
    abort_decoder,
    encoder,
    outputs_decoder,
    pack_time,
    request_decoder,
    unpack_time,
)
from fastdeploy.engine.global_scheduler.redis_scheduler import (
    GlobalScheduler,
    GlobalSchedulerConfig,
    ScheduledRequest,
    ScheduledResult,
    SchedulerConnectionError,
)
from fastdeploy.engine.request import EngineCoreOutput, EngineCoreOutputs, FinishReason
from fastdeploy.logger import init_logger
from fastdeploy.platforms.cpu_binding import bind_current_thread

logger = init_logger("fastdeploy.engine.global_scheduler.bridge")

_output_decoder = msgspec.msgpack.Decoder(EngineCoreOutput)

# How long the bridge waits for the core loop between two rounds of Redis polling: short while
# this instance waits for results computed elsewhere (they stream to a client), longer otherwise
# (taking or stealing work a little later costs little), and long while Redis is down.
POLL_BUSY_S = 0.01
POLL_IDLE_S = 0.05
POLL_DOWN_S = 0.5
# How often stolen requests are checked for aborts by their origin, and instances for liveness.
ABORT_CHECK_S = 0.25
LIVENESS_CHECK_S = 2.0


class BridgeMessage(bytes, enum.Enum):
    """First frame of a message between the core loop and the bridge thread."""

    # core -> bridge. Frame 1: an encoded EngineCoreRequest this instance's API submitted.
    SUBMIT = b"S"
    # core -> bridge. Frame 1: encoded list[str], request ids this instance's API aborted.
    ABORT = b"A"
    # core -> bridge. Frame 1: EngineCoreOutputs of stolen requests; frame 2: the step start time.
    RESULTS = b"R"
    # core -> bridge. Frame 1: encoded list[str], taken requests that left the core (finished, aborted).
    DONE = b"D"
    # bridge -> core. Frame 1: an encoded EngineCoreRequest to run; frame 2: b"1" when stolen.
    RUN = b"N"
    # bridge -> core. Frame 1: encoded list[str], taken requests to drop.
    CANCEL = b"X"


class CoreEndpoint:
    """The core loop's end of the bridge; only the core loop's thread uses it.

    It remembers which requests in the core came from the bridge, so that outputs of stolen ones
    are diverted to their origin and the bridge learns when the core has room again.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.socket = sock
        # Requests the bridge handed to the core and that are still there -> stolen from another instance.
        self._taken: dict[str, bool] = {}
        # Requests taken since the last scheduler stats, by source (for /metrics).
        self._num_own = 0
        self._num_stolen = 0

    def submit(self, payload: Any) -> None:
        """A request from this instance's API (its encoded EngineCoreRequest): queue it in Redis."""
        self.socket.send_multipart((BridgeMessage.SUBMIT.value, payload), copy=False)

    def aborted(self, request_ids: list[str]) -> None:
        """The API aborted these; the core has already dropped the ones it held."""
        self._left(request_ids)
        self.socket.send_multipart((BridgeMessage.ABORT.value, encoder.encode(request_ids)))

    def taken(self, request_id: str, stolen: bool) -> None:
        """The core is about to run a request the bridge handed it."""
        self._taken[request_id] = stolen
        if stolen:
            self._num_stolen += 1
        else:
            self._num_own += 1

    def cancelled(self, request_ids: list[str]) -> None:
        """The core dropped these at the bridge's request."""
        self._left(request_ids)

    def route(self, outputs: EngineCoreOutputs, step_start: float) -> EngineCoreOutputs:
        """Divert the outputs of stolen requests to the bridge; return what goes to the API."""
        stats = outputs.scheduler_stats
        if stats is not None and (self._num_own or self._num_stolen):
            stats.num_global_own_reqs, stats.num_global_stolen_reqs = self._num_own, self._num_stolen
            self._num_own = self._num_stolen = 0
        taken = self._taken
        if not taken:
            return outputs
        local: list[EngineCoreOutput] = []
        remote: list[EngineCoreOutput] = []
        done: list[str] = []
        for output in outputs.outputs:
            stolen = taken.get(output.request_id)
            (remote if stolen else local).append(output)
            if stolen is not None and output.finish_reason is not None:
                del taken[output.request_id]
                done.append(output.request_id)
        if remote:
            outputs.outputs = local
            self.socket.send_multipart((BridgeMessage.RESULTS.value,
                                        encoder.encode(EngineCoreOutputs(outputs=remote)), pack_time(step_start)))
        if done:
            self.socket.send_multipart((BridgeMessage.DONE.value, encoder.encode(done)))
        return outputs

    def _left(self, request_ids: list[str]) -> None:
        done = [r for r in request_ids if self._taken.pop(r, None) is not None]
        if done:
            self.socket.send_multipart((BridgeMessage.DONE.value, encoder.encode(done)))

    def close(self) -> None:
        self.socket.close(linger=0)


@dataclass
class _Inbox:
    """What the core loop sent since the bridge last looked."""

    submits: list[tuple[str, bytes, int]] = field(default_factory=list)  # (request_id, payload, prompt tokens)
    aborts: list[str] = field(default_factory=list)
    results: list[tuple[EngineCoreOutputs, float]] = field(default_factory=list)
    done: list[str] = field(default_factory=list)


class GlobalSchedulerBridge:
    """Owns this instance's :class:`GlobalScheduler` and the thread that moves work through it.

    Args:
        config: where the shared Redis is and the topic.
        capacity: the most requests the local core holds at once (``max_num_seqs``); the bridge
            takes work from Redis only while the core has fewer, so queued work stays where an idle
            instance can steal it.
        io_cores: the cores the bridge thread runs on (the API process's, ``CpuBinding.api``);
            None leaves it on the engine's. It wakes every few milliseconds to talk to Redis: on
            the engine's cores those wake-ups stall steps, and behind a busy step there (another
            instance's engine pinned to the same core) its polls were measured 0.4-0.9 s late, so
            an idle instance never saw the busy one's queue.

    Raises:
        SchedulerConnectionError: Redis cannot be reached (the message names host:port).
    """

    def __init__(self, config: GlobalSchedulerConfig, capacity: int, io_cores: frozenset[int] | None = None) -> None:
        try:
            import redis  # noqa: F401
        except ImportError as e:
            raise RuntimeError("--scheduler-name global needs the redis package: pip install redis") from e
        self.scheduler = GlobalScheduler(config)
        self.name = self.scheduler.name
        self.capacity = max(1, capacity)
        self.io_cores = io_cores
        self._address = f"inproc://fd-global-scheduler-{uuid.uuid4().hex[:12]}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pair: zmq.Socket | None = None
        self._out: zmq.Socket | None = None
        # State of the bridge thread (no other thread touches it).
        # This instance's requests not finished yet (queued, running here or elsewhere).
        self._own: set[str] = set()
        # Requests in the local core -> their origin instance ("" for this instance's own).
        self._handed: dict[str, str] = {}
        # This instance's requests that another instance took -> that instance.
        self._runner: dict[str, str] = {}
        # Stolen requests whose final result has not reached their origin yet -> origin.
        self._stolen: dict[str, str] = {}
        # Final error results for stolen requests that this instance had to drop, until Redis takes them.
        self._notices: dict[str, ScheduledResult] = {}
        # This instance's requests whose abort mark still has to reach Redis.
        self._to_abort: set[str] = set()
        self._reported_load = -1
        self._next_abort_check = 0.0
        self._next_liveness_check = 0.0
        self._down = False

    @classmethod
    def from_config(cls, fd_config: FDConfig, io_cores: frozenset[int] | None = None) -> GlobalSchedulerBridge | None:
        """The bridge for ``--scheduler-name global``; None for the local scheduler."""
        sc = fd_config.scheduler_config
        if sc.scheduler_name != "global":
            return None
        return cls(GlobalSchedulerConfig.from_args(sc), sc.max_num_seqs, io_cores)

    # ---- the core loop's side ----------------------------------------------------------------
    def start(self, ctx: zmq.Context, output_address: str) -> CoreEndpoint:
        """Start the bridge thread; return the core loop's end (bound here, in the loop's thread)."""
        sock = ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._address)
        self._thread = threading.Thread(target=self._run, args=(ctx, output_address), name="global-scheduler-bridge",
                                        daemon=True)
        self._thread.start()
        return CoreEndpoint(sock)

    def close(self, timeout_s: float = 3.0) -> bool:
        """Stop the thread and leave the topic; False when the thread did not stop (its sockets stay open)."""
        self._stop.set()
        stopped = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            stopped = not self._thread.is_alive()
        self.scheduler.close()
        return stopped

    # ---- the bridge thread -------------------------------------------------------------------
    def _run(self, ctx: zmq.Context, output_address: str) -> None:
        try:
            bind_current_thread(self.io_cores)
        except OSError as e:  # e.g. the cpuset changed since start-up: the engine's cores still work
            logger.warning("Global scheduler bridge stays on the engine's cores: cannot bind to %s: %s",
                           sorted(self.io_cores or ()), e)
        pair = self._pair = ctx.socket(zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(self._address)
        out = self._out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.SNDHWM, 0)
        out.setsockopt(zmq.LINGER, 1000)
        out.connect(output_address)
        try:
            while not self._stop.is_set():
                if self._down:
                    timeout = POLL_DOWN_S
                elif len(self._own) > sum(1 for origin in self._handed.values() if not origin):
                    timeout = POLL_BUSY_S  # some of our requests are queued or run elsewhere
                else:
                    timeout = POLL_IDLE_S
                inbox = self._read_inbox(pair, timeout)
                self._round(inbox)
        except Exception as e:
            # A bug here would leave callers waiting forever: fail the whole engine loudly instead.
            logger.exception("The global scheduler bridge failed.")
            out.send_multipart((EngineCoreOutputType.DEAD.value,
                                f"Global scheduler bridge failed: {type(e).__name__}: {e}".encode()))
        finally:
            pair.close(linger=0)
            out.close()

    def _read_inbox(self, pair: zmq.Socket, timeout_s: float) -> _Inbox:
        inbox = _Inbox()
        if not pair.poll(int(timeout_s * 1000)):
            return inbox
        while True:
            try:
                frames = pair.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return inbox
            kind = frames[0]
            if kind == BridgeMessage.SUBMIT.value:
                request = request_decoder.decode(frames[1])
                inbox.submits.append((request.request_id, frames[1], len(request.prompt_token_ids)))
            elif kind == BridgeMessage.ABORT.value:
                inbox.aborts.extend(abort_decoder.decode(frames[1]))
            elif kind == BridgeMessage.RESULTS.value:
                inbox.results.append((outputs_decoder.decode(frames[1]), unpack_time(frames[2])))
            elif kind == BridgeMessage.DONE.value:
                inbox.done.extend(abort_decoder.decode(frames[1]))
            else:
                logger.error("Unknown bridge message %r ignored.", kind)

    def _round(self, inbox: _Inbox) -> None:
        """Book what the core sent, then one exchange with Redis."""
        for request_id, _, _ in inbox.submits:
            self._own.add(request_id)
        for request_id in inbox.done:
            if self._handed.pop(request_id, None) == "":
                self._own.discard(request_id)
                self.scheduler.forget([request_id])
        self._book_aborts(inbox.aborts)
        try:
            self._deliver_notices()
            self._put_results(inbox.results)
            self._submit([s for s in inbox.submits if s[0] in self._own])
            if self._to_abort:
                self.scheduler.abort(sorted(self._to_abort))
                self._to_abort.clear()
            self._take_work()
            self._get_results()
            self._check_aborts_and_liveness()
            load = len(self._handed)
            if load != self._reported_load:
                self.scheduler.report_load(load)
                self._reported_load = load
        except SchedulerConnectionError as e:
            self._redis_down(e)
            return
        if self._down:
            self._down = False
            logger.info("The global scheduler's Redis answers again; requests are shared again.")

    # ---- requests of this instance -------------------------------------------------------------
    def _book_aborts(self, request_ids: list[str]) -> None:
        """The API gave up on these: the core drops the ones here, Redis marks the others."""
        here = []
        for request_id in request_ids:
            if request_id not in self._own:
                continue
            self._own.discard(request_id)
            self._runner.pop(request_id, None)
            if request_id in self._handed:
                # May still be on its way to the core (RUN sent, not read yet): drop it there too.
                here.append(request_id)
            else:
                self._to_abort.add(request_id)
        if here:
            self._send_core(BridgeMessage.CANCEL, encoder.encode(here))

    def _submit(self, submits: list[tuple[str, bytes, int]]) -> None:
        if not submits:
            return
        outcome = self.scheduler.put_requests([ScheduledRequest(request_id, payload, num_prompt_tokens=n)
                                               for request_id, payload, n in submits])
        refused = {request_id: error for request_id, error in outcome if error is not None}
        if refused:
            self._own.difference_update(refused)
            self._fail_to_api({r: f"Global scheduler refused request {r}: {e}" for r, e in refused.items()})

    def _get_results(self) -> None:
        """Results of this instance's requests that other instances ran: to the API, one message per step."""
        results = self.scheduler.get_results()
        if not results:
            return
        steps: dict[tuple[str, float], list[EngineCoreOutput]] = defaultdict(list)
        for request_id, items in results.items():
            if request_id not in self._own or request_id in self._handed:
                continue  # aborted or failed meanwhile: its caller is gone
            for item in items:
                output_bytes, step_start, runner = item.payload
                self._runner[request_id] = runner
                if output_bytes is None:
                    continue  # the taker's claim: only tells who runs it
                steps[(runner, step_start)].append(_output_decoder.decode(output_bytes))
                if item.finished:
                    self._own.discard(request_id)
                    self._runner.pop(request_id, None)
                    break
        for (_, step_start), outputs in sorted(steps.items(), key=lambda kv: kv[0][1]):
            self._send_api(EngineCoreOutputs(outputs=outputs, timestamp=time.time()), step_start)

    # ---- requests taken from Redis ------------------------------------------------------------
    def _take_work(self) -> None:
        room = self.capacity - len(self._handed)
        if room <= 0:
            return
        taken = self.scheduler.get_requests(max_num=room)
        if not taken:
            return
        aborted = self.scheduler.aborted({r.request_id: r.origin for r in taken})
        claims = []
        for request in taken:
            request_id, own = request.request_id, request.origin == self.name
            if request_id in aborted or (own and request_id not in self._own):
                self.scheduler.forget([request_id])
                continue
            self._handed[request_id] = "" if own else request.origin
            if not own:
                self._stolen[request_id] = request.origin
                claims.append(ScheduledResult(request_id, [None, 0.0, self.name]))
            self._send_core(BridgeMessage.RUN, request.payload, b"1" if not own else b"0")
        if claims:
            self.scheduler.put_results(claims)

    def _put_results(self, batches: list[tuple[EngineCoreOutputs, float]]) -> None:
        results = []
        for outputs, step_start in batches:
            for output in outputs.outputs:
                if output.request_id in self._stolen and output.request_id not in self._notices:
                    results.append(ScheduledResult(output.request_id, [encoder.encode(output), step_start, self.name],
                                                   output.finish_reason is not None))
        if not results:
            return
        self.scheduler.put_results(results)
        for result in results:
            if result.finished:
                self._stolen.pop(result.request_id, None)

    def _check_aborts_and_liveness(self) -> None:
        now = time.monotonic()
        running_stolen = {r: origin for r, origin in self._handed.items() if origin and r in self._stolen}
        if running_stolen and now >= self._next_abort_check:
            self._next_abort_check = now + ABORT_CHECK_S
            self._drop_stolen(self.scheduler.aborted(running_stolen))
        if (self._runner or running_stolen) and now >= self._next_liveness_check:
            self._next_liveness_check = now + LIVENESS_CHECK_S
            alive = self.scheduler.alive_instances()
            # Nobody is left to answer these callers.
            self._drop_stolen({r for r, origin in running_stolen.items() if origin not in alive})
            lost = {r: runner for r, runner in self._runner.items() if runner not in alive}
            if lost:
                expiry = self.scheduler.config.instance_expiry_s
                for request_id in lost:
                    self._own.discard(request_id)
                    del self._runner[request_id]
                self.scheduler.forget(list(lost))
                self._fail_to_api({r: f"Global scheduler: instance {runner} that took request {r} stopped "
                                      f"(no heartbeat for {expiry:g} s)." for r, runner in lost.items()})

    def _drop_stolen(self, request_ids: set[str]) -> None:
        """Stop stolen requests nobody waits for any more."""
        if not request_ids:
            return
        for request_id in request_ids:
            self._stolen.pop(request_id, None)
        self.scheduler.forget(list(request_ids))
        self._send_core(BridgeMessage.CANCEL, encoder.encode(sorted(request_ids)))

    def _deliver_notices(self) -> None:
        if not self._notices:
            return
        notices = list(self._notices.values())
        self.scheduler.put_results(notices)
        for notice in notices:
            self._stolen.pop(notice.request_id, None)
        self._notices.clear()

    # ---- Redis down ---------------------------------------------------------------------------
    def _redis_down(self, error: SchedulerConnectionError) -> None:
        """Fail what depends on Redis now, rather than let callers wait for it."""
        message = str(error)
        if not self._down:
            self._down = True
            logger.error("%s (requests that need it fail until it answers again)", message)
        # Ours that are queued or run elsewhere: their outputs may be lost, so they fail.
        failed = [r for r in self._own if r not in self._handed]
        for request_id in failed:
            self._own.discard(request_id)
            self._runner.pop(request_id, None)
        if failed:
            self.scheduler.forget(failed)
            # Whoever runs them stops once Redis is back.
            self._to_abort.update(failed)
            self._fail_to_api(dict.fromkeys(failed, message))
        # Stolen ones: their outputs may not have reached their origin, which is told once Redis is back.
        broken = [r for r in self._stolen if r not in self._notices]
        if broken:
            error_text = f"Global scheduler: instance {self.name} lost Redis while running this request: {message}"
            for request_id in broken:
                output = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT, error=error_text)
                self._notices[request_id] = ScheduledResult(
                    request_id, [encoder.encode(output), time.time(), self.name], finished=True)
            here = [r for r in broken if r in self._handed]
            if here:
                self._send_core(BridgeMessage.CANCEL, encoder.encode(here))

    # ---- sockets ------------------------------------------------------------------------------
    def _fail_to_api(self, errors: dict[str, str]) -> None:
        now = time.time()
        outputs = [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT, error=e) for r, e in errors.items()]
        self._send_api(EngineCoreOutputs(outputs=outputs, timestamp=now), now)

    def _send_api(self, outputs: EngineCoreOutputs, step_start: float) -> None:
        self._out.send_multipart((EngineCoreOutputType.OUTPUTS.value, encoder.encode(outputs), pack_time(step_start)))

    def _send_core(self, kind: BridgeMessage, *frames: bytes) -> None:
        self._pair.send_multipart((kind.value, *frames))
