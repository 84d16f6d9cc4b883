"""Time helpers: UTC normalisation, local-time resolution, minute buckets.

Every instant that crosses a module boundary is a timezone-aware UTC
``datetime``. Naive times given by users are read in the app's timezone, as
Celery does, and rejected when that local time is ambiguous or does not exist.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo

from celery_sched.errors import AmbiguousTime, NonExistentTime, UnknownTimezone

UTC = dt.UTC
EPOCH = dt.datetime(1970, 1, 1, tzinfo=UTC)
_MINUTE = dt.timedelta(minutes=1)
_SECOND = dt.timedelta(seconds=1)


def get_zone(name: str) -> dt.tzinfo:
    """Return the IANA zone called ``name``, or raise :class:`UnknownTimezone`."""
    if name.upper() == "UTC":
        return UTC
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise UnknownTimezone(f"unknown timezone {name!r}") from exc


def ensure_utc(value: dt.datetime, *, name: str = "datetime") -> dt.datetime:
    """Return an aware ``value`` converted to UTC; reject naive values."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{name} must be timezone-aware, got naive {value.isoformat()}")
    return value.astimezone(UTC)


def resolve_local(value: dt.datetime, zone: dt.tzinfo) -> dt.datetime:
    """Read a naive ``value`` as wall-clock time in ``zone`` and return UTC.

    Raises :class:`AmbiguousTime` when the wall-clock time occurs twice (clocks
    fall back) and :class:`NonExistentTime` when it is skipped (clocks spring
    forward): guessing would fire a job an hour early or late.
    """
    if value.tzinfo is not None:
        return ensure_utc(value)
    first = value.replace(tzinfo=zone, fold=0)
    second = value.replace(tzinfo=zone, fold=1)
    if first.utcoffset() != second.utcoffset():
        # A gap and an overlap both give two offsets; only a real time
        # survives the round trip through UTC.
        back = first.astimezone(UTC).astimezone(zone).replace(tzinfo=None)
        if back != value:
            raise NonExistentTime(
                f"{value.isoformat()} does not exist in {zone} (clocks spring forward); "
                "give an aware datetime or a time outside the gap"
            )
        raise AmbiguousTime(
            f"{value.isoformat()} occurs twice in {zone} (clocks fall back); "
            "give an aware datetime to choose one"
        )
    return first.astimezone(UTC)


def to_bucket(value: dt.datetime) -> int:
    """Whole minutes since the Unix epoch, floored, for an aware datetime."""
    return int((value - EPOCH) // _MINUTE)


def bucket_start(bucket: int) -> dt.datetime:
    """The UTC instant at which minute bucket ``bucket`` begins."""
    return EPOCH + bucket * _MINUTE


def to_epoch_seconds(value: dt.datetime) -> float:
    """Seconds since the Unix epoch for an aware datetime (the ZSET score)."""
    return (value - EPOCH) / _SECOND


def from_epoch_seconds(value: float) -> dt.datetime:
    """The aware UTC datetime for seconds since the Unix epoch."""
    return EPOCH + dt.timedelta(seconds=value)
