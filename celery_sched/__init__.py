"""celery_sched: a Celery beat replacement backed by PostgreSQL and Redis.

Public names: :class:`Client`, :class:`Task` (the idempotent task base
class), :class:`Job`, :class:`JobStatus`, :class:`ScheduleInfo`, the schedule
policies, ``clocked`` (a one-off schedule for ``beat_schedule``) and the
exceptions in :mod:`celery_sched.errors`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_sched.errors import (
    AmbiguousTime,
    CelerySchedError,
    ConfigurationError,
    DuplicateJob,
    InvalidArguments,
    InvalidJob,
    InvalidSchedule,
    InvalidTime,
    InvalidURL,
    LedgerConflict,
    NonExistentTime,
    PayloadTooLarge,
    ScheduleExists,
    StoreUnavailable,
    UnknownOption,
    UnknownSchedule,
    UnknownTask,
    UnknownTimezone,
    UntrustedContent,
)
from celery_sched.models import Job, JobStatus, MisfirePolicy, OverlapPolicy, ScheduleInfo

if TYPE_CHECKING:
    from celery_sched.client import Client
    from celery_sched.schedules import clocked
    from celery_sched.task import Task

__version__ = "0.1.0"

__all__ = [
    "AmbiguousTime",
    "CelerySchedError",
    "Client",
    "ConfigurationError",
    "DuplicateJob",
    "InvalidArguments",
    "InvalidJob",
    "InvalidSchedule",
    "InvalidTime",
    "InvalidURL",
    "Job",
    "JobStatus",
    "LedgerConflict",
    "MisfirePolicy",
    "NonExistentTime",
    "OverlapPolicy",
    "PayloadTooLarge",
    "ScheduleExists",
    "ScheduleInfo",
    "StoreUnavailable",
    "Task",
    "UnknownOption",
    "UnknownSchedule",
    "UnknownTask",
    "UnknownTimezone",
    "UntrustedContent",
    "clocked",
]


def __getattr__(name: str) -> Any:
    # Client pulls in Celery and the database driver; import it on first
    # use so `celery -A proj beat -S celery_sched` stays cheap to load.
    if name == "Client":
        from celery_sched.client import Client

        return Client
    if name == "clocked":
        from celery_sched.schedules import clocked

        return clocked
    if name == "Task":
        from celery_sched.task import Task

        return Task
    raise AttributeError(f"module 'celery_sched' has no attribute {name!r}")
