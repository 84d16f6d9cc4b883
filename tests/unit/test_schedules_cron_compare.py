"""A year of crontab occurrences compared with cronsim, an independent cron evaluator.

cronsim mimics Debian cron, whose DST rules are ours: a wildcard job (minute
or hour field starting with ``*``: ``*/5 * * * *``, ``0 * * * *``,
``0 */6 * * *``) runs at every real instant whose local time matches, both
passes of a repeated hour and nothing made up for a skipped one; a
fixed-time job runs a repeated time once, at its first instant, and a
skipped time at the end of the gap. The comparison is exact in every zone,
through every DST change, except in two known places, each checked to be
exactly that case:

1. Day matching. Celery's crontab ANDs ``day_of_week`` and ``day_of_month``;
   classic cron ORs them when both are restricted. That case is compared
   against cronsim's day-of-month expression filtered by the weekday.
2. Wildcard expressions on Lord Howe's 30-minute shift days: cronsim (2.9)
   steps through hours in real time from the shifted half hour, so it steps
   over some matching wall times that exist once (``0 */6 * * *`` at 06:00
   on 7 Apr and 6 Oct 2024, ``15 */2 * * *`` at 02:15 on 7 Apr, just after
   the repeated half hour); Debian cron, which checks every minute, runs
   them, and so do we. Only ours has those; nothing is only cronsim's.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab
from cronsim import CronSim

from celery_sched.models import ScheduleSpec
from celery_sched.schedules import make_spec, next_after

UTC = dt.UTC
YEAR = 2024

ZONES = ["UTC", "America/New_York", "Europe/London", "Australia/Lord_Howe", "Australia/Sydney"]

Keep = Callable[[dt.datetime], bool]


def _any(_local: dt.datetime) -> bool:
    return True


def _monday(local: dt.datetime) -> bool:
    return local.weekday() == 0


def _friday(local: dt.datetime) -> bool:
    return local.weekday() == 4


# (Celery cron string, cronsim expression, filter on cronsim's local times)
CASES: list[tuple[str, str, Keep]] = [
    ("*/5 * * * *", "*/5 * * * *", _any),
    ("0 * * * *", "0 * * * *", _any),
    ("0 */6 * * *", "0 */6 * * *", _any),
    ("*/10 1,2 * * *", "*/10 1,2 * * *", _any),  # wildcard minute in every zone's DST hours
    ("15 */2 * * *", "15 */2 * * *", _any),  # 02:15: New York's, Lord Howe's, Sydney's gap
    ("30 2 * * *", "30 2 * * *", _any),  # inside New York's spring gap
    ("30 1 * * *", "30 1 * * *", _any),  # inside New York's fall repeat, London's gap
    ("15 2 * * *", "15 2 * * *", _any),  # inside Lord Howe's 30-minute gap
    ("20 2,3 * * *", "20 2,3 * * *", _any),  # a gap time and the hour after it
    ("0,30 1-3 * * *", "0,30 1-3 * * *", _any),  # several times in one gap collapse
    ("0 9 * * 1-5", "0 9 * * 1-5", _any),  # weekdays
    ("45 23 * * 6,0", "45 23 * * 6,0", _any),  # weekends
    ("0 0 31 * *", "0 0 31 * *", _any),  # only months with a 31st
    ("15 10 1 1,4,7,10 *", "15 10 1 1,4,7,10 *", _any),  # month list
    ("0 12 * 2,3,11 0", "0 12 * 2,3,11 0", _any),  # month list and weekday: ANDed in both
    ("5 4 29 2 *", "5 4 29 2 *", _any),  # leap day
    ("*/20 8-17 * * 1-5", "*/20 8-17 * * 1-5", _any),  # business hours
    # Celery: the first Monday of each month (dom AND dow); cron would OR them.
    ("0 9 1-7 * 1", "0 9 1-7 * *", _monday),
    # cron's forms that Celery's parser lacks
    ("5/15 1-3 * * *", "5/15 1-3 * * *", _any),  # start/step, in the DST hours
    ("0 5/6 * * *", "0 5/6 * * *", _any),
    ("0 4 1/10 * *", "0 4 1/10 * *", _any),
    ("0 22 * * 7", "0 22 * * 7", _any),  # 7 = Sunday
    ("0 6 * * 5-7", "0 6 * * 5-7", _any),
    ("0 7 * * 1/2", "0 7 * * 1/2", _any),  # 1-7/2: Monday, Wednesday, Friday, Sunday
    ("30 1 L * *", "30 1 L * *", _any),  # the last day of the month
    ("15 2 LW * *", "15 2 LW * *", _any),  # its last weekday
    ("0 9 * * 5L", "0 9 * * 5L", _any),  # its last Friday
    ("45 1 * * 7L", "45 1 * * 7L", _any),  # last Sunday: in London's gap and repeat
    ("0 9 * * 1#2", "0 9 * * 1#2", _any),  # its second Monday
    ("30 2 * * 0#2", "30 2 * * 0#2", _any),  # second Sunday: in New York's spring gap
    ("0 12 * * 1#5", "0 12 * * 1#5", _any),  # a fifth Monday, in some months only
    # The last day of the month when it is a Friday (AND); cron would OR them.
    ("0 9 L * 5", "0 9 L * *", _friday),
]

DENSE = {"*/5 * * * *", "*/20 8-17 * * 1-5"}


@pytest.fixture(scope="module")
def app() -> Celery:
    return Celery("t")


def _wildcard(expression: str) -> bool:
    """Whether ``expression`` is a wildcard job (cronsim walks real time for it)."""
    minute, hour = expression.split()[:2]
    return minute.startswith("*") or hour.startswith("*")


def _ours(spec: ScheduleSpec, start: dt.datetime, end: dt.datetime) -> list[dt.datetime]:
    out: list[dt.datetime] = []
    moment = next_after(spec, start)
    while moment is not None and moment < end:
        out.append(moment)
        moment = next_after(spec, moment)
    return out


def _theirs(
    expression: str, keep: Keep, tz: dt.tzinfo, start: dt.datetime, end: dt.datetime
) -> list[dt.datetime]:
    out: list[dt.datetime] = []
    for local in CronSim(expression, start.astimezone(tz)):
        moment = local.astimezone(UTC)
        if moment >= end:
            break
        if keep(local):
            out.append(moment)
    return out


def _matches(spec: ScheduleSpec, wall: dt.datetime) -> bool:
    """Whether a wall-clock minute matches the crontab, read from Celery's own
    expanded fields (day of week AND day of month, Sunday = 0)."""
    cron: Any = crontab(**spec.spec)
    return (
        wall.second == 0
        and wall.minute in cron.minute
        and wall.hour in cron.hour
        and wall.day in cron.day_of_month
        and wall.month in cron.month_of_year
        and wall.isoweekday() % 7 in cron.day_of_week
    )


def _shift_on(day: dt.date, tz: dt.tzinfo) -> dt.timedelta:
    """How far the clocks move during local ``day`` (zero on most days)."""
    start = dt.datetime(day.year, day.month, day.day, tzinfo=tz)
    end = (start.astimezone(UTC) + dt.timedelta(days=1, hours=1)).astimezone(tz)
    offsets = (start.utcoffset(), end.utcoffset())
    assert offsets[0] is not None and offsets[1] is not None
    return offsets[1] - offsets[0]


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize(
    ("expression", "theirs_expression", "keep"),
    [
        pytest.param(*case, id=case[0], marks=[pytest.mark.slow] if case[0] in DENSE else [])
        for case in CASES
    ],
)
def test_a_year_agrees_with_cronsim(
    app: Celery, zone: str, expression: str, theirs_expression: str, keep: Keep
) -> None:
    tz = zoneinfo.ZoneInfo(zone)
    spec = make_spec("job", "tasks.job", expression, app=app, timezone=zone)
    start = dt.datetime(YEAR, 1, 1, tzinfo=tz).astimezone(UTC) - dt.timedelta(seconds=1)
    end = dt.datetime(YEAR + 1, 1, 1, tzinfo=tz).astimezone(UTC)

    ours = _ours(spec, start, end)
    theirs = _theirs(theirs_expression, keep, tz, start, end)

    assert ours, "every case fires at least once in 2024"
    assert ours == sorted(set(ours)), "strictly increasing"
    only_ours = sorted(set(ours) - set(theirs))
    only_theirs = sorted(set(theirs) - set(ours))
    assert only_theirs == []
    if zone != "Australia/Lord_Howe" or not _wildcard(theirs_expression):
        assert only_ours == []
        return

    # Difference 2 (see the module docstring): each extra of ours is a
    # matching, unambiguous time on a day whose clocks move by 30 minutes,
    # which cronsim's real-time hour steps walk over.
    for moment in only_ours:
        local = moment.astimezone(tz)
        assert abs(_shift_on(local.date(), tz)) == dt.timedelta(minutes=30), moment
        assert _matches(spec, local.replace(tzinfo=None)), f"{local} does not match"
        assert local.replace(fold=1 - local.fold).utcoffset() == local.utcoffset(), local
    assert len(only_ours) <= 2  # at most one per shift day


def test_celery_ands_day_of_week_with_day_of_month(app: Celery) -> None:
    """The first Monday of each month, as Celery reads ``1-7`` + ``mon``."""
    spec = make_spec("first-monday", "t", "0 9 1-7 * 1", app=app, timezone="UTC")
    start = dt.datetime(YEAR, 1, 1, tzinfo=UTC)
    got = _ours(spec, start, dt.datetime(YEAR + 1, 1, 1, tzinfo=UTC))
    assert len(got) == 12
    assert all(moment.weekday() == 0 and moment.day <= 7 for moment in got)
    assert got[0] == dt.datetime(2024, 1, 1, 9, tzinfo=UTC)  # 1 Jan 2024 was a Monday
