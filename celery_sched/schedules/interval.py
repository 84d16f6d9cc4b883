"""Interval schedules: a fixed step in absolute time from the previous
*nominal* instant, so nothing drifts however late the planner runs."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from celery_sched.errors import InvalidSchedule
from celery_sched.schedules.compiled import Compiled
from celery_sched.schedules.wallclock import (
    DAY,
    HOUR,
    MICROSECOND,
    MINUTE,
    SECOND,
    wall_to_utc,
)
from celery_sched.timeutil import UTC

#: Interval lengths by their seconds, filled as intervals compile, so that
#: :func:`~celery_sched.schedules.evaluate.next_after` steps an interval
#: without looking up its compiled form.
INTERVALS: dict[Any, dt.timedelta] = {}


class CompiledInterval(Compiled):
    """An interval: steps of ``every`` in absolute time; with ``relative``
    the first one is aligned on the wall clock of ``zone``."""

    def __init__(self, seconds: float, relative: bool, zone: dt.tzinfo) -> None:
        self.every = dt.timedelta(seconds=seconds)
        if self.every <= dt.timedelta(0):
            raise InvalidSchedule(f"interval must be positive, got {seconds!r} seconds")
        self.relative = relative
        self.zone = zone
        self.probe = max(HOUR, self.every)
        if len(INTERVALS) < 65536:
            INTERVALS[seconds] = self.every

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        try:
            return after + self.every
        except OverflowError:
            return None

    def anchor(self, now: dt.datetime) -> dt.datetime:
        if not self.relative:
            return now
        return self._aligned_first(now) - self.every

    def _aligned_first(self, now: dt.datetime) -> dt.datetime:
        # As celery.utils.time.remaining(relative=True): the last boundary
        # of the interval's resolution at or before now + every, on the wall
        # clock; day intervals add calendar days.
        every = self.every
        if every >= DAY:
            local = now.astimezone(self.zone).replace(tzinfo=None)
            midnight = (local + every).replace(hour=0, minute=0, second=0, microsecond=0)
            first = wall_to_utc(midnight, self.zone)
            return first if first > now else now + every
        target = now + every
        unit = HOUR if every >= HOUR else MINUTE if every >= MINUTE else SECOND
        wall = _floor(target.astimezone(self.zone).replace(tzinfo=None), unit)
        # Rounding down can land in a repeated hour (both passes count) and,
        # when clocks fall back by part of an hour or off the hour, before
        # now: then the next boundary is the first, as in Celery.
        boundaries = _instants(wall, self.zone)
        if every >= MINUTE:
            boundaries += _instants(wall + unit, self.zone)
        future = [moment for moment in boundaries if moment > now]
        before_target = [moment for moment in future if moment <= target]
        if before_target:
            return max(before_target)
        return min(future, default=target)

    def count(self, cursor: dt.datetime, cutoff: dt.datetime) -> int:
        if cutoff <= cursor:
            return 0
        return (cutoff - cursor - MICROSECOND) // self.every

    def latest(
        self, cursor: dt.datetime, floor: dt.datetime | None, cutoff: dt.datetime, n: int
    ) -> list[dt.datetime]:
        last = self.count(cursor, cutoff)  # steps k = 1..last are before cutoff
        first = max(1, last - n + 1)
        if floor is not None and floor > cursor:
            first = max(first, -((cursor - floor) // self.every))  # ceil((floor-cursor)/every)
        return [cursor + k * self.every for k in range(first, last + 1)]


def _floor(wall: dt.datetime, unit: dt.timedelta) -> dt.datetime:
    """``wall`` (naive) rounded down to a whole ``unit`` (second, minute or hour)."""
    if unit == HOUR:
        return wall.replace(minute=0, second=0, microsecond=0, fold=0)
    if unit == MINUTE:
        return wall.replace(second=0, microsecond=0, fold=0)
    return wall.replace(microsecond=0, fold=0)


def _instants(wall: dt.datetime, zone: dt.tzinfo) -> list[dt.datetime]:
    """The instants a naive wall-clock time stands for: both passes of a
    repeated time, the end of the gap for one that does not exist."""
    first = wall_to_utc(wall.replace(fold=0), zone)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    # In a gap the fold=1 reading lies before the first: it is no instant.
    return [first, second] if second > first else [first]


def interval_definition(what: str, every: Any) -> dict[str, Any]:
    """The JSON spec of an interval given as seconds or a timedelta;
    InvalidSchedule unless it is positive and at least a microsecond."""
    seconds = every.total_seconds() if isinstance(every, dt.timedelta) else every
    if type(seconds) is bool or not isinstance(seconds, (int, float)):
        raise InvalidSchedule(f"{what}: interval must be a number of seconds, got {every!r}")
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidSchedule(f"{what}: interval must be positive, got {seconds!r} seconds")
    if seconds < 1e-6:
        raise InvalidSchedule(f"{what}: interval must be at least a microsecond, got {seconds!r}")
    return {"seconds": seconds}
