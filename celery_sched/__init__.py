"""celery_sched: a Celery beat replacement backed by PostgreSQL and Redis.

Public names: :class:`Client`, :class:`Job`, :class:`JobStatus`
and the exceptions in :mod:`celery_sched.errors`.
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
    NonExistentTime,
    PayloadTooLarge,
    StoreUnavailable,
    UnknownOption,
    UnknownTask,
    UnknownTimezone,
)
from celery_sched.models import Job, JobStatus

if TYPE_CHECKING:
    from celery_sched.client import Client

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
    "NonExistentTime",
    "PayloadTooLarge",
    "StoreUnavailable",
    "UnknownOption",
    "UnknownTask",
    "UnknownTimezone",
]


def __getattr__(name: str) -> Any:
    # Client pulls in Celery and the database driver; import it on first
    # use so `celery -A proj beat -S celery_sched` stays cheap to load.
    if name == "Client":
        from celery_sched.client import Client

        return Client
    raise AttributeError(f"module 'celery_sched' has no attribute {name!r}")
