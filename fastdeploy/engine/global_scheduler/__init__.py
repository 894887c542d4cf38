"""The global scheduler (``--scheduler-name global``): instances share request queues through Redis.

Not the engine's own scheduler (continuous batching, chunked prefill, preemption), which is
:mod:`fastdeploy.engine.sched`. This one decides which *instance* runs a request:

- :mod:`.redis_scheduler`: :class:`GlobalScheduler`, the queues and load table in Redis;
- :mod:`.bridge`: :class:`~.bridge.GlobalSchedulerBridge`, the engine core's thread between its
  loop and Redis (used by :mod:`fastdeploy.engine.core_proc`).
"""

from fastdeploy.engine.global_scheduler.redis_scheduler import (
    GlobalScheduler,
    GlobalSchedulerConfig,
    ScheduledRequest,
    ScheduledResult,
    SchedulerConnectionError,
)

__all__ = ["GlobalScheduler", "GlobalSchedulerConfig", "ScheduledRequest", "ScheduledResult",
           "SchedulerConnectionError"]
