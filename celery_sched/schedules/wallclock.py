"""Wall-clock time and its DST rules: naive local times mapped to UTC instants.

Crontabs are evaluated on the wall clock of their timezone, and ``relative``
intervals align to its boundaries. Two readings of a local time, for the
two kinds of crontab Vixie/Debian cron tells apart
(:class:`~celery_sched.schedules.cron.CompiledCron`):

- :func:`wall_to_utc`, one instant per local time (fixed-time jobs,
  intervals): a local time that does not exist (clocks spring forward) maps
  to the first valid instant after the gap; a repeated local time (clocks
  fall back) maps to its first instant.
- :func:`wall_instants`, every instant at which the clock reads that time
  (wildcard jobs): none in a gap, both in a repeat.
"""

from __future__ import annotations

import datetime as dt

from celery_sched.timeutil import EPOCH, UTC

MICROSECOND = dt.timedelta(microseconds=1)
SECOND = dt.timedelta(seconds=1)
MINUTE = dt.timedelta(minutes=1)
HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)
_EPOCH_NAIVE = EPOCH.replace(tzinfo=None)


def wall_to_utc(wall: dt.datetime, zone: dt.tzinfo) -> dt.datetime:
    """The instant a naive wall-clock time in ``zone`` stands for.

    A repeated time (clocks fall back) is its first instant; a time that does
    not exist (clocks spring forward) is the first valid instant after the
    gap, i.e. the transition itself. The map never decreases as ``wall``
    grows, which is what lets the crontab search walk wall-clock time.
    """
    before = wall.replace(tzinfo=zone).utcoffset()
    after = wall.replace(tzinfo=zone, fold=1).utcoffset()
    assert before is not None and after is not None
    if before >= after:  # unambiguous, or repeated (fold=0 is the first pass)
        return (wall - before).replace(tzinfo=UTC)
    # In a gap fold=0 reads the time with the offset before the transition
    # and fold=1 with the one after; the transition lies between the two
    # readings. Transitions fall on whole seconds: bisect for it.
    low = (wall - after - _EPOCH_NAIVE) // SECOND  # offset `before` here
    high = (wall - before - _EPOCH_NAIVE) // SECOND  # offset `after` here
    while high - low > 1:
        middle = (low + high) // 2
        if dt.datetime.fromtimestamp(middle, zone).utcoffset() == after:
            high = middle
        else:
            low = middle
    return EPOCH + dt.timedelta(seconds=high)


def wall_instants(wall: dt.datetime, zone: dt.tzinfo) -> tuple[dt.datetime, ...]:
    """Every instant at which the wall clock of ``zone`` reads ``wall``
    (naive), ascending: none in a gap (clocks spring forward), two in a
    repeat (clocks fall back), else one."""
    before = wall.replace(tzinfo=zone).utcoffset()
    after = wall.replace(tzinfo=zone, fold=1).utcoffset()
    assert before is not None and after is not None
    if before == after:
        return ((wall - before).replace(tzinfo=UTC),)
    if before < after:  # in a gap the two readings straddle the transition
        return ()
    return (wall - before).replace(tzinfo=UTC), (wall - after).replace(tzinfo=UTC)


def _steady_offset(day: dt.datetime, zone: dt.tzinfo) -> dt.timedelta | None:
    """The UTC offset of the whole local day starting at midnight ``day``
    (naive), or None if the offset changes during it."""
    end = day + DAY
    offset = zone.utcoffset(day)
    if (
        offset is None
        or zone.utcoffset(day.replace(fold=1)) != offset
        or zone.utcoffset(end) != offset
        or zone.utcoffset(end.replace(fold=1)) != offset
    ):
        return None
    return offset


_UNKNOWN = object()


class WallClock:
    """:func:`wall_to_utc` and :func:`wall_instants` for one zone, fast on the
    days (nearly all) whose offset does not change: those are remembered by
    ordinal."""

    def __init__(self, zone: dt.tzinfo) -> None:
        self.zone = zone
        self._days: dict[int, dt.timedelta | None] = {}

    def day_offset(self, wall: dt.datetime) -> dt.timedelta | None:
        """The offset of ``wall``'s whole local day, None if it changes."""
        ordinal = wall.toordinal()
        offset = self._days.get(ordinal, _UNKNOWN)
        if offset is _UNKNOWN:
            midnight = dt.datetime.fromordinal(ordinal)
            offset = _steady_offset(midnight, self.zone)
            if len(self._days) >= 4096:
                self._days.clear()
            self._days[ordinal] = offset
        return offset  # type: ignore[return-value]

    def instant(self, wall: dt.datetime) -> dt.datetime:
        offset = self.day_offset(wall)
        if offset is None:
            return wall_to_utc(wall, self.zone)
        return EPOCH + (wall - _EPOCH_NAIVE - offset)

    def instants(self, wall: dt.datetime) -> tuple[dt.datetime, ...]:
        offset = self.day_offset(wall)
        if offset is None:
            return wall_instants(wall, self.zone)
        return (EPOCH + (wall - _EPOCH_NAIVE - offset),)
