"""Request schedulers shared across instances (``--scheduler-name global``: Redis)."""

from fastdeploy.scheduler.global_scheduler import (
    GlobalScheduler,
    GlobalSchedulerConfig,
    ScheduledRequest,
    ScheduledResult,
    SchedulerConnectionError,
)

__all__ = ["GlobalScheduler", "GlobalSchedulerConfig", "ScheduledRequest", "ScheduledResult",
           "SchedulerConnectionError"]
