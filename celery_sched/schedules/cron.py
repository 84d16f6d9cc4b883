"""Crontab schedules: Celery's cron fields, matched on the wall clock of the
schedule's timezone (see :mod:`~celery_sched.schedules.wallclock` for DST).

``day_of_week`` and ``day_of_month`` are ANDed, as Celery's crontab does
(classic cron ORs them). Five-field cron strings and macros such as
``"@daily"`` are read here too.
"""

from __future__ import annotations

import bisect
import calendar
import datetime as dt
import functools
from collections.abc import Mapping
from typing import Any

from celery.schedules import crontab

from celery_sched.errors import InvalidSchedule
from celery_sched.schedules.compiled import Compiled
from celery_sched.schedules.wallclock import DAY, MICROSECOND, MINUTE, WallClock
from celery_sched.timeutil import UTC

#: The keys of a crontab spec, in Celery's constructor order.
CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")

# A (month, day, weekday) combination that occurs at all occurs within any
# 400 years: the Gregorian calendar repeats exactly every 400 years.
_CRON_YEARS = 400

_CRON_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}


def cron_from_string(what: str, text: str) -> crontab:
    """Celery's crontab for a five-field cron string (minute hour
    day-of-month month day-of-week) or a macro such as ``"@daily"``."""
    expression = _CRON_MACROS.get(text.strip().lower(), text)
    parts = expression.split()
    if len(parts) != 5:
        raise InvalidSchedule(
            f"{what}: cron string {text!r} must have 5 fields "
            "(minute hour day-of-month month day-of-week)"
        )
    minute, hour, day_of_month, month_of_year, day_of_week = parts
    fields = {
        "minute": minute,
        "hour": hour,
        "day_of_week": day_of_week,
        "day_of_month": day_of_month,
        "month_of_year": month_of_year,
    }
    return parse_crontab(what, fields)


def parse_crontab(what: str, fields: Mapping[str, str]) -> crontab:
    """Celery's crontab for ``fields``; InvalidSchedule names the bad field."""
    try:
        return crontab(**fields)
    except Exception as exc:  # Celery raises ValueError, TypeError or ParseException
        for field in CRON_FIELDS:
            try:
                crontab(**{field: fields[field]})
            except Exception as field_exc:
                raise InvalidSchedule(
                    f"{what}: invalid crontab field {field}={fields[field]!r}: {field_exc}"
                ) from exc
        raise InvalidSchedule(f"{what}: crontab never fires: {exc}") from exc


def cron_text(original: Any, expanded: set[int], low: int, size: int) -> str:
    """The cron string of a crontab field: the user's own text when given as
    text, else the expanded values (``*`` when every value is in)."""
    if isinstance(original, str):
        return original.strip()
    if set(expanded) == set(range(low, low + size)):
        return "*"
    return ",".join(str(value) for value in sorted(expanded))


class CompiledCron(Compiled):
    """A crontab on the wall clock of a zone, with Celery's field semantics."""

    probe = 2 * MINUTE

    def __init__(self, fields: Mapping[str, Any], zone: dt.tzinfo) -> None:
        cron: Any = parse_crontab("crontab", {field: str(fields[field]) for field in CRON_FIELDS})
        self.minutes = sorted(cron.minute)
        self.hours = sorted(cron.hour)
        self.months = sorted(cron.month_of_year)
        self.month_set = frozenset(self.months)
        self.days = frozenset(cron.day_of_month)
        self.weekdays = frozenset(cron.day_of_week)  # 0 = Sunday
        self.zone = zone
        self.clock = WallClock(zone)
        self.per_day = len(self.minutes) * len(self.hours)

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        zone = self.zone
        local = after if zone is UTC else after.astimezone(zone)
        try:
            wall = dt.datetime(local.year, local.month, local.day, local.hour, local.minute)
            wall += MINUTE
            while True:
                found = self._next_wall(wall)
                if found is None:
                    return None
                instant = self.clock.instant(found)
                # Only when `after` lies in the second pass of a repeated hour
                # do wall times after it map to instants before it.
                if instant > after:
                    return instant
                wall = found + MINUTE
        except OverflowError:  # past year 9999
            return None

    def _next_wall(self, wall: dt.datetime) -> dt.datetime | None:
        """The first matching wall-clock minute at or after ``wall`` (naive),
        skipping whole months, days and hours that cannot match."""
        year, month, day, hour, minute = wall.year, wall.month, wall.day, wall.hour, wall.minute
        months, hours, minutes = self.months, self.hours, self.minutes
        last_year = min(year + _CRON_YEARS, dt.MAXYEAR)
        while year <= last_year:
            if month not in self.month_set:
                index = bisect.bisect_left(months, month)
                if index == len(months):
                    year += 1
                    month = months[0]
                else:
                    month = months[index]
                day, hour, minute = 1, 0, 0
                continue
            found_day = self._next_day(year, month, day)
            if found_day is None:
                month += 1
                if month > 12:
                    year += 1
                    month = 1
                day, hour, minute = 1, 0, 0
                continue
            if found_day != day:
                day, hour, minute = found_day, 0, 0
            index = bisect.bisect_left(hours, hour)
            if index == len(hours):
                day, hour, minute = day + 1, 0, 0
                continue
            if hours[index] != hour:
                hour, minute = hours[index], 0
            index = bisect.bisect_left(minutes, minute)
            if index == len(minutes):
                hour, minute = hour + 1, 0
                continue
            return dt.datetime(year, month, day, hour, minutes[index])
        return None

    def _next_day(self, year: int, month: int, day: int) -> int | None:
        first_weekday, days_in_month = _month_shape(year, month)
        days, weekdays = self.days, self.weekdays
        for candidate in range(day, days_in_month + 1):
            # Celery ANDs day_of_month and day_of_week (cron ORs them).
            if candidate in days and (first_weekday + candidate) % 7 in weekdays:
                return candidate
        return None

    def count(self, cursor: dt.datetime, cutoff: dt.datetime) -> int:
        # A day without an offset change holds every hour x minute pair:
        # count it in one step instead of visiting each occurrence.
        zone, clock, per_day = self.zone, self.clock, self.per_day
        first_hour, first_minute = self.hours[0], self.minutes[0]
        total = 0
        moment = self.next_after(cursor)
        while moment is not None and moment < cutoff:
            local = moment if zone is UTC else moment.astimezone(zone)
            if per_day > 1 and local.hour == first_hour and local.minute == first_minute:
                midnight = dt.datetime(local.year, local.month, local.day)
                if clock.day_offset(midnight) is not None:
                    day_end = clock.instant(midnight + DAY)
                    if day_end <= cutoff:
                        total += per_day
                        moment = self.next_after(day_end - MICROSECOND)
                        continue
            total += 1
            moment = self.next_after(moment)
        return total


@functools.lru_cache(maxsize=4096)
def _month_shape(year: int, month: int) -> tuple[int, int]:
    """(weekday of the 1st with Monday = 0, days in the month)."""
    return calendar.monthrange(year, month)
