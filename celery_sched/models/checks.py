"""What every value object checks: datetimes are aware UTC, and numbers fit
what the store holds."""

from __future__ import annotations

import datetime as dt

from celery_sched.timeutil import EPOCH, UTC, ensure_utc

#: The first due time the store cannot hold: ``jobs.due_bucket`` is a 32-bit
#: count of minutes since the Unix epoch, which ends early in 6053. Later
#: due times are refused with ``InvalidTime``.
DUE_LIMIT = EPOCH + dt.timedelta(minutes=2**31)

#: The earliest due time a new job may have: an earlier one is a mistake (a
#: typo in the year, a zero timestamp), refused with ``InvalidTime`` before
#: it reaches the store (it would need a partition of its own).
DUE_FLOOR = dt.datetime(2000, 1, 1, tzinfo=UTC)

#: The largest span, in seconds, of any duration a job or schedule may give
#: (interval, expires, catch-up window, visibility timeout, max_runtime, time
#: limits): 1000 years. Longer ones are no use, and would overflow the
#: arithmetic the planner (datetime) or the reconciler (PostgreSQL intervals
#: off ``now()``) does with them.
MAX_SECONDS = 1000 * 365.25 * 86400

#: The largest value of an ``integer`` column (``max_attempts``, ``max_catchup``).
MAX_INT32 = 2**31 - 1


def check_aware(obj: object, *names: str) -> None:
    """Make the datetime fields ``names`` of a frozen value aware UTC in place;
    ValueError for a naive one (see :func:`~celery_sched.timeutil.ensure_utc`)."""
    for name in names:
        value = getattr(obj, name)
        # Already UTC is the common case on hot paths (bulk scheduling, claims).
        if value is not None and value.tzinfo is not UTC:
            object.__setattr__(obj, name, ensure_utc(value, name=name))
