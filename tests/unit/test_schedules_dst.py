"""Crontab schedules across DST changes, with every expected instant spelled out.

The rules (README "Timezones and DST", ``celery_sched.schedules.cron``), as
Vixie/Debian cron has them. A crontab is evaluated on the wall clock of its
timezone, and:

- a *wildcard job* (its minute or hour field starts with ``*``: ``*/15 * * * *``,
  ``0 * * * *``, ``0 */6 * * *``) runs by the new wall clock: at every real
  instant whose local time matches, so both passes of a repeated hour, and
  in a skipped hour only what the clock reads after the jump, no catch-up;
- a *fixed-time job* (any other) runs a local time that does not exist
  (clocks spring forward) once, at the first valid instant after the gap,
  several such times in one gap collapsing into that instant, and a
  repeated local time (clocks fall back) once, at its first instant.

2024 transitions used below:

- America/New_York: 10 Mar 02:00 EST -> 03:00 EDT (07:00Z); 3 Nov 02:00 EDT
  -> 01:00 EST (06:00Z), so 01:00-02:00 happens twice.
- Europe/London: 31 Mar 01:00 GMT -> 02:00 BST (01:00Z); 27 Oct 02:00 BST ->
  01:00 GMT (01:00Z).
- Australia/Lord_Howe (a 30-minute shift): 7 Apr 02:00 +11 -> 01:30 +10:30
  (15:00Z on the 6th); 6 Oct 02:00 +10:30 -> 02:30 +11 (15:30Z on the 5th).
- Australia/Sydney (southern hemisphere: the fold in April, the gap in
  October): 7 Apr 03:00 AEDT -> 02:00 AEST (16:00Z on the 6th); 6 Oct 02:00
  AEST -> 03:00 AEDT (16:00Z on the 5th).
- America/Santiago (southern, changing at midnight): 6 Apr 24:00 -03 -> 23:00
  -04 (03:00Z on the 7th); 8 Sep 00:00 -04 -> 01:00 -03 (04:00Z), so midnight
  does not exist that day.
- Asia/Tokyo: +09:00 all year.
"""

from __future__ import annotations

import datetime as dt
import itertools
import zoneinfo
from collections import Counter

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_sched.models import ScheduleSpec
from celery_sched.schedules import first_after, make_spec, next_after

UTC = dt.UTC


@pytest.fixture(scope="module")
def app() -> Celery:
    return Celery("t")


def z(text: str) -> dt.datetime:
    """An aware UTC instant from 'YYYY-MM-DD HH:MM'."""
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def cron(app: Celery, zone: str, **fields: str) -> ScheduleSpec:
    return make_spec("job", "tasks.job", crontab(**fields), app=app, timezone=zone)


def run(spec: ScheduleSpec, start: dt.datetime, until: dt.datetime) -> list[dt.datetime]:
    """Every occurrence strictly after ``start`` and at or before ``until``."""
    out: list[dt.datetime] = []
    moment = next_after(spec, start)
    while moment is not None and moment <= until:
        out.append(moment)
        moment = next_after(spec, moment)
    return out


# -- America/New_York ------------------------------------------------------------


def test_new_york_nightly_0230_fires_at_0300_edt_on_spring_forward_day(app: Celery) -> None:
    spec = cron(app, "America/New_York", minute="30", hour="2")
    assert run(spec, z("2024-03-08 12:00"), z("2024-03-12 12:00")) == [
        z("2024-03-09 07:30"),  # 02:30 EST
        z("2024-03-10 07:00"),  # 02:30 does not exist: 03:00 EDT, the first valid instant
        z("2024-03-11 06:30"),  # 02:30 EDT
        z("2024-03-12 06:30"),
    ]


def test_new_york_nightly_0130_fires_once_on_fall_back_day(app: Celery) -> None:
    spec = cron(app, "America/New_York", minute="30", hour="1")
    assert run(spec, z("2024-11-01 12:00"), z("2024-11-05 12:00")) == [
        z("2024-11-02 05:30"),  # 01:30 EDT
        z("2024-11-03 05:30"),  # 01:30 happens twice: only the first (EDT)
        z("2024-11-04 06:30"),  # 01:30 EST
        z("2024-11-05 06:30"),
    ]


def test_new_york_hourly_wildcard_job_runs_every_real_hour(app: Celery) -> None:
    """``0 * * * *``: a wildcard job (its hour is ``*``) runs by the new wall clock."""
    spec = cron(app, "America/New_York", minute="0")
    assert run(spec, z("2024-03-10 04:30"), z("2024-03-10 09:00")) == [
        z("2024-03-10 05:00"),  # 00:00 EST
        z("2024-03-10 06:00"),  # 01:00 EST
        z("2024-03-10 07:00"),  # 03:00 EDT: 02:00 does not exist and is not made up
        z("2024-03-10 08:00"),  # 04:00 EDT
        z("2024-03-10 09:00"),
    ]
    assert run(spec, z("2024-11-03 03:30"), z("2024-11-03 09:00")) == [
        z("2024-11-03 04:00"),  # 00:00 EDT
        z("2024-11-03 05:00"),  # 01:00 EDT
        z("2024-11-03 06:00"),  # 01:00 EST, the repeat: no two-hour hole (celery#10107)
        z("2024-11-03 07:00"),  # 02:00 EST
        z("2024-11-03 08:00"),
        z("2024-11-03 09:00"),
    ]


def test_readme_examples_new_york(app: Celery) -> None:
    """The four examples of the README's "Timezones and DST", as written there."""
    wildcard = cron(app, "America/New_York", minute="0")
    assert run(wildcard, z("2024-11-03 03:30"), z("2024-11-03 07:00")) == [
        z("2024-11-03 04:00"),  # 00:00 EDT
        z("2024-11-03 05:00"),  # 01:00 EDT
        z("2024-11-03 06:00"),  # 01:00 EST
        z("2024-11-03 07:00"),  # 02:00 EST
    ]
    half_past = cron(app, "America/New_York", minute="30")
    assert run(half_past, z("2024-03-10 06:00"), z("2024-03-10 08:00")) == [
        z("2024-03-10 06:30"),  # 01:30 EST
        z("2024-03-10 07:30"),  # 03:30 EDT; 02:30 never happens and is not made up
    ]
    fixed_fold = cron(app, "America/New_York", minute="30", hour="1")
    assert run(fixed_fold, z("2024-11-03 04:00"), z("2024-11-03 12:00")) == [
        z("2024-11-03 05:30"),  # 01:30 EDT only
    ]
    fixed_gap = cron(app, "America/New_York", minute="30", hour="2")
    assert run(fixed_gap, z("2024-03-10 05:00"), z("2024-03-10 12:00")) == [
        z("2024-03-10 07:00"),  # 03:00 EDT, the first valid instant after the gap
    ]
    collapsed = cron(app, "America/New_York", minute="0,30", hour="2")
    assert run(collapsed, z("2024-03-10 05:00"), z("2024-03-10 12:00")) == [
        z("2024-03-10 07:00"),  # 02:00 and 02:30 collapse into one run at 03:00 EDT
    ]


def test_new_york_every_15_minutes_across_both_transitions(app: Celery) -> None:
    spec = cron(app, "America/New_York", minute="*/15")
    assert run(spec, z("2024-03-10 06:20"), z("2024-03-10 07:30")) == [
        z("2024-03-10 06:30"),  # 01:30 EST
        z("2024-03-10 06:45"),  # 01:45 EST
        z("2024-03-10 07:00"),  # 03:00 EDT; 02:00-02:45 do not exist, no catch-up
        z("2024-03-10 07:15"),  # 03:15 EDT
        z("2024-03-10 07:30"),
    ]
    assert run(spec, z("2024-11-03 04:50"), z("2024-11-03 07:15")) == [
        z("2024-11-03 05:00"),  # 01:00 EDT
        z("2024-11-03 05:15"),
        z("2024-11-03 05:30"),
        z("2024-11-03 05:45"),  # 01:45 EDT
        z("2024-11-03 06:00"),  # 01:00 EST: the repeated hour runs again
        z("2024-11-03 06:15"),
        z("2024-11-03 06:30"),
        z("2024-11-03 06:45"),  # 01:45 EST
        z("2024-11-03 07:00"),  # 02:00 EST
        z("2024-11-03 07:15"),
    ]


def test_new_york_star_minute_makes_a_wildcard_job_a_minute_list_does_not(
    app: Celery,
) -> None:
    """``*/15 1 * * *`` is a wildcard job (its minute starts with ``*``): both
    passes of 01:00-02:00 on the fall-back day, and ``*/15 2 * * *`` nothing
    on the spring-forward day, whose 01:59 EST is followed by 03:00 EDT.
    ``0,15,30,45 1 * * *`` matches the same wall times but names its
    minutes: a fixed-time job, once in the fold and at the end of the gap."""
    spec = cron(app, "America/New_York", minute="*/15", hour="1")
    assert run(spec, z("2024-11-03 00:00"), z("2024-11-04 00:00")) == [
        z("2024-11-03 05:00"),  # 01:00 EDT
        z("2024-11-03 05:15"),
        z("2024-11-03 05:30"),
        z("2024-11-03 05:45"),
        z("2024-11-03 06:00"),  # 01:00 EST
        z("2024-11-03 06:15"),
        z("2024-11-03 06:30"),
        z("2024-11-03 06:45"),
    ]
    in_gap = cron(app, "America/New_York", minute="*/15", hour="2")
    assert run(in_gap, z("2024-03-09 12:00"), z("2024-03-11 12:00")) == [
        z("2024-03-11 06:00"),  # 11 Mar 02:00 EDT; 10 Mar has no 02:00-02:59
        z("2024-03-11 06:15"),
        z("2024-03-11 06:30"),
        z("2024-03-11 06:45"),
    ]
    fixed = cron(app, "America/New_York", minute="0,15,30,45", hour="1")
    assert run(fixed, z("2024-11-03 00:00"), z("2024-11-04 00:00")) == [
        z("2024-11-03 05:00"),  # 01:00 EDT
        z("2024-11-03 05:15"),
        z("2024-11-03 05:30"),
        z("2024-11-03 05:45"),  # the EST pass is not run again
    ]
    fixed_in_gap = cron(app, "America/New_York", minute="0,15,30,45", hour="2")
    assert run(fixed_in_gap, z("2024-03-10 00:00"), z("2024-03-10 12:00")) == [
        z("2024-03-10 07:00"),  # 02:00-02:45 do not exist: one run at 03:00 EDT
    ]


def test_new_york_after_inside_the_repeated_hour(app: Celery) -> None:
    """From an instant in either pass of 01:00-02:00 the next occurrence is
    the next real one: a wildcard job continues through the repeat, a
    fixed-time job resumes after it, never at a first-pass instant in the past."""
    spec = cron(app, "America/New_York", minute="*/15")
    first_pass_0150 = z("2024-11-03 05:50")  # 01:50 EDT
    second_pass_0120 = z("2024-11-03 06:20")  # 01:20 EST
    assert next_after(spec, first_pass_0150) == z("2024-11-03 06:00")  # 01:00 EST
    assert first_after(spec, first_pass_0150) == z("2024-11-03 06:00")
    assert next_after(spec, second_pass_0120) == z("2024-11-03 06:30")  # 01:30 EST
    assert first_after(spec, second_pass_0120) == z("2024-11-03 06:30")
    assert next_after(spec, z("2024-11-03 06:50")) == z("2024-11-03 07:00")  # 02:00 EST
    fixed = cron(app, "America/New_York", minute="0,15,30,45", hour="1,2")
    assert next_after(fixed, first_pass_0150) == z("2024-11-03 07:00")  # 02:00 EST
    assert next_after(fixed, second_pass_0120) == z("2024-11-03 07:00")


@pytest.mark.parametrize(
    "schedule",
    [crontab(minute="*/15"), "*/15 * * * *", crontab(minute="*/15", hour="*/1"), "*/15 */1 * * *"],
)
def test_crontab_objects_and_cron_strings_are_wildcard_jobs_alike(
    app: Celery, schedule: object
) -> None:
    spec = make_spec("job", "tasks.job", schedule, app=app, timezone="America/New_York")
    assert run(spec, z("2024-11-03 05:50"), z("2024-11-03 07:00")) == [
        z("2024-11-03 06:00"),
        z("2024-11-03 06:15"),
        z("2024-11-03 06:30"),
        z("2024-11-03 06:45"),
        z("2024-11-03 07:00"),
    ]


# -- Europe/London ----------------------------------------------------------------


def test_london_nightly_0130_across_both_transitions(app: Celery) -> None:
    spec = cron(app, "Europe/London", minute="30", hour="1")
    assert run(spec, z("2024-03-29 12:00"), z("2024-04-01 12:00")) == [
        z("2024-03-30 01:30"),  # 01:30 GMT
        z("2024-03-31 01:00"),  # 01:30 does not exist: 02:00 BST
        z("2024-04-01 00:30"),  # 01:30 BST
    ]
    assert run(spec, z("2024-10-25 12:00"), z("2024-10-28 12:00")) == [
        z("2024-10-26 00:30"),  # 01:30 BST
        z("2024-10-27 00:30"),  # repeated: the first, BST
        z("2024-10-28 01:30"),  # 01:30 GMT
    ]


def test_london_hourly_and_quarter_hourly_across_both_transitions(app: Celery) -> None:
    hourly = cron(app, "Europe/London", minute="0")
    assert run(hourly, z("2024-03-30 23:30"), z("2024-03-31 03:00")) == [
        z("2024-03-31 00:00"),  # 00:00 GMT
        z("2024-03-31 01:00"),  # 02:00 BST; 01:00 does not exist and is not made up
        z("2024-03-31 02:00"),  # 03:00 BST
        z("2024-03-31 03:00"),
    ]
    assert run(hourly, z("2024-10-26 22:30"), z("2024-10-27 03:00")) == [
        z("2024-10-26 23:00"),  # 00:00 BST
        z("2024-10-27 00:00"),  # 01:00 BST
        z("2024-10-27 01:00"),  # 01:00 GMT, the repeat
        z("2024-10-27 02:00"),  # 02:00 GMT
        z("2024-10-27 03:00"),
    ]
    half_past = cron(app, "Europe/London", minute="30")
    assert run(half_past, z("2024-03-31 00:00"), z("2024-03-31 02:00")) == [
        z("2024-03-31 00:30"),  # 00:30 GMT
        z("2024-03-31 01:30"),  # 02:30 BST; 01:30 does not exist and is not made up
    ]
    quarter = cron(app, "Europe/London", minute="*/15")
    assert run(quarter, z("2024-03-31 00:40"), z("2024-03-31 01:15")) == [
        z("2024-03-31 00:45"),  # 00:45 GMT
        z("2024-03-31 01:00"),  # 02:00 BST; 01:00-01:45 do not exist, no catch-up
        z("2024-03-31 01:15"),  # 02:15 BST
    ]
    assert run(quarter, z("2024-10-26 23:40"), z("2024-10-27 02:00")) == [
        z("2024-10-26 23:45"),  # 00:45 BST
        z("2024-10-27 00:00"),  # 01:00 BST
        z("2024-10-27 00:15"),
        z("2024-10-27 00:30"),
        z("2024-10-27 00:45"),  # 01:45 BST
        z("2024-10-27 01:00"),  # 01:00 GMT: the repeated hour runs again
        z("2024-10-27 01:15"),
        z("2024-10-27 01:30"),
        z("2024-10-27 01:45"),  # 01:45 GMT
        z("2024-10-27 02:00"),  # 02:00 GMT
    ]


# -- Australia/Lord_Howe: a 30-minute shift -----------------------------------------------


def test_lord_howe_nightly_jobs_across_both_transitions(app: Celery) -> None:
    in_gap = cron(app, "Australia/Lord_Howe", minute="15", hour="2")
    assert run(in_gap, z("2024-10-04 12:00"), z("2024-10-07 12:00")) == [
        z("2024-10-04 15:45"),  # 5 Oct 02:15 +10:30
        z("2024-10-05 15:30"),  # 6 Oct 02:15 does not exist: 02:30 +11
        z("2024-10-06 15:15"),  # 7 Oct 02:15 +11
    ]
    repeated = cron(app, "Australia/Lord_Howe", minute="45", hour="1")
    assert run(repeated, z("2024-04-05 00:00"), z("2024-04-08 00:00")) == [
        z("2024-04-05 14:45"),  # 6 Apr 01:45 +11
        z("2024-04-06 14:45"),  # 7 Apr 01:45 happens twice: the first, +11
        z("2024-04-07 15:15"),  # 8 Apr 01:45 +10:30
    ]


def test_lord_howe_hourly_and_quarter_hourly_across_both_transitions(app: Celery) -> None:
    hourly = cron(app, "Australia/Lord_Howe", minute="0")
    assert run(hourly, z("2024-10-05 14:00"), z("2024-10-05 17:00")) == [
        z("2024-10-05 14:30"),  # 01:00 +10:30
        # 02:00 does not exist: the clock reads 02:30 +11 (15:30Z), not on the hour
        z("2024-10-05 16:00"),  # 03:00 +11, 90 minutes later
        z("2024-10-05 17:00"),
    ]
    assert run(hourly, z("2024-04-06 13:30"), z("2024-04-06 17:00")) == [
        z("2024-04-06 14:00"),  # 01:00 +11 (01:00 is not in the repeated half hour)
        z("2024-04-06 15:30"),  # 02:00 +10:30, 90 minutes later
        z("2024-04-06 16:30"),
    ]
    quarter = cron(app, "Australia/Lord_Howe", minute="*/15")
    assert run(quarter, z("2024-10-05 15:00"), z("2024-10-05 16:00")) == [
        z("2024-10-05 15:15"),  # 01:45 +10:30
        z("2024-10-05 15:30"),  # 02:30 +11; 02:00 and 02:15 do not exist, no catch-up
        z("2024-10-05 15:45"),  # 02:45 +11
        z("2024-10-05 16:00"),
    ]
    assert run(quarter, z("2024-04-06 14:20"), z("2024-04-06 15:45")) == [
        z("2024-04-06 14:30"),  # 01:30 +11
        z("2024-04-06 14:45"),  # 01:45 +11
        z("2024-04-06 15:00"),  # 01:30 +10:30: the repeated half hour runs again
        z("2024-04-06 15:15"),  # 01:45 +10:30
        z("2024-04-06 15:30"),  # 02:00 +10:30
        z("2024-04-06 15:45"),
    ]


# -- southern hemisphere: Australia/Sydney and America/Santiago -------------------------


def test_sydney_wildcard_and_fixed_time_jobs_across_both_transitions(app: Celery) -> None:
    hourly = cron(app, "Australia/Sydney", minute="0")
    assert run(hourly, z("2024-04-06 14:30"), z("2024-04-06 17:00")) == [
        z("2024-04-06 15:00"),  # 7 Apr 02:00 AEDT
        z("2024-04-06 16:00"),  # 02:00 AEST, the repeat
        z("2024-04-06 17:00"),  # 03:00 AEST
    ]
    half_past = cron(app, "Australia/Sydney", minute="30")
    assert run(half_past, z("2024-10-05 15:00"), z("2024-10-05 17:00")) == [
        z("2024-10-05 15:30"),  # 6 Oct 01:30 AEST
        z("2024-10-05 16:30"),  # 03:30 AEDT; 02:30 does not exist and is not made up
    ]
    # A fixed-time job through the same fold and gap.
    nightly = cron(app, "Australia/Sydney", minute="30", hour="2")
    assert run(nightly, z("2024-04-05 12:00"), z("2024-04-08 12:00")) == [
        z("2024-04-05 15:30"),  # 6 Apr 02:30 AEDT
        z("2024-04-06 15:30"),  # 7 Apr 02:30 happens twice: the first, AEDT
        z("2024-04-07 16:30"),  # 8 Apr 02:30 AEST
    ]
    assert run(nightly, z("2024-10-04 12:00"), z("2024-10-07 12:00")) == [
        z("2024-10-04 16:30"),  # 5 Oct 02:30 AEST
        z("2024-10-05 16:00"),  # 6 Oct 02:30 does not exist: 03:00 AEDT
        z("2024-10-06 15:30"),  # 7 Oct 02:30 AEDT
    ]


def test_santiago_wildcard_and_fixed_time_jobs_across_midnight_transitions(app: Celery) -> None:
    hourly = cron(app, "America/Santiago", minute="0")
    assert run(hourly, z("2024-04-07 01:30"), z("2024-04-07 04:00")) == [
        z("2024-04-07 02:00"),  # 6 Apr 23:00 -03
        z("2024-04-07 03:00"),  # 6 Apr 23:00 -04, the repeat
        z("2024-04-07 04:00"),  # 7 Apr 00:00 -04
    ]
    half_past = cron(app, "America/Santiago", minute="30")
    assert run(half_past, z("2024-09-08 03:00"), z("2024-09-08 05:00")) == [
        z("2024-09-08 03:30"),  # 7 Sep 23:30 -04
        z("2024-09-08 04:30"),  # 8 Sep 01:30 -03; 00:30 does not exist and is not made up
    ]
    # Fixed-time jobs through the same fold and gap.
    late = cron(app, "America/Santiago", minute="30", hour="23")
    assert run(late, z("2024-04-06 00:00"), z("2024-04-09 00:00")) == [
        z("2024-04-06 02:30"),  # 5 Apr 23:30 -03
        z("2024-04-07 02:30"),  # 6 Apr 23:30 happens twice: the first, -03
        z("2024-04-08 03:30"),  # 7 Apr 23:30 -04
    ]
    midnight = cron(app, "America/Santiago", minute="0", hour="0")
    assert run(midnight, z("2024-09-07 00:00"), z("2024-09-10 00:00")) == [
        z("2024-09-07 04:00"),  # 7 Sep 00:00 -04
        z("2024-09-08 04:00"),  # 8 Sep 00:00 does not exist: 01:00 -03
        z("2024-09-09 03:00"),  # 9 Sep 00:00 -03
    ]


# -- a wildcard job all year --------------------------------------------------------------


@pytest.mark.parametrize(
    "zone",
    [
        "America/New_York",
        "Europe/London",
        "Australia/Lord_Howe",
        "Australia/Sydney",
        "America/Santiago",
    ],
)
def test_every_30_minutes_runs_every_real_half_hour_of_2024(app: Celery, zone: str) -> None:
    """Every shift in these zones is 30 or 60 minutes, so ``*/30 * * * *``
    read on the new wall clock is every real half hour: nothing lost when
    clocks fall back, nothing doubled when they spring forward."""
    spec = cron(app, zone, minute="*/30")
    start = z("2024-01-01 00:00")
    got = run(spec, start, z("2025-01-01 00:00"))
    assert got[0] == z("2024-01-01 00:30")
    assert {b - a for a, b in itertools.pairwise(got)} == {dt.timedelta(minutes=30)}
    assert len(got) == 366 * 48


# -- zones without DST ---------------------------------------------------------------


@pytest.mark.parametrize("zone", ["Asia/Tokyo", "UTC"])
def test_zone_without_dst_keeps_a_fixed_offset(app: Celery, zone: str) -> None:
    offset = dt.timedelta(hours=9 if zone == "Asia/Tokyo" else 0)
    spec = cron(app, zone, minute="30", hour="2")
    got = run(spec, z("2023-12-31 00:00"), z("2025-01-01 00:00"))
    days = [(moment + offset).date() for moment in got]
    assert len(got) == len(set(days)) >= 366
    assert all((moment + offset).time() == dt.time(2, 30) for moment in got)
    quarter = cron(app, zone, minute="*/15")
    steps = run(quarter, z("2024-03-09 00:00"), z("2024-11-05 00:00"))
    assert {b - a for a, b in itertools.pairwise(steps)} == {dt.timedelta(minutes=15)}


# -- once per day across a whole year ---------------------------------------------------

DAILY_CASES = [
    ("America/New_York", "30", "2"),  # in the spring gap
    ("America/New_York", "30", "1"),  # in the fall repeat
    ("Europe/London", "30", "1"),  # in both
    ("Australia/Lord_Howe", "15", "2"),  # in the 30-minute gap
    ("Australia/Lord_Howe", "45", "1"),  # in the 30-minute repeat
    ("Asia/Tokyo", "30", "2"),
]


@pytest.mark.parametrize(("zone", "minute", "hour"), DAILY_CASES)
def test_nightly_job_fires_exactly_once_every_local_day_of_2024(
    app: Celery, zone: str, minute: str, hour: str
) -> None:
    tz = zoneinfo.ZoneInfo(zone)
    spec = cron(app, zone, minute=minute, hour=hour)
    start = dt.datetime(2024, 1, 1, tzinfo=tz).astimezone(UTC) - dt.timedelta(microseconds=1)
    until = dt.datetime(2024, 12, 31, 23, 59, tzinfo=tz).astimezone(UTC)
    got = run(spec, start, until)
    per_day = Counter(moment.astimezone(tz).date() for moment in got)
    assert len(per_day) == 366  # 2024 is a leap year
    assert set(per_day.values()) == {1}
    wanted = dt.time(int(hour), int(minute))
    shifted = [m.astimezone(tz) for m in got if m.astimezone(tz).time() != wanted]
    # Only the spring-forward day may fire late, and then at the end of the gap.
    assert len(shifted) <= 1
    for moment in shifted:
        # (Aware arithmetic within one zone is wall-clock arithmetic: go via UTC.)
        before = (moment.astimezone(UTC) - dt.timedelta(seconds=1)).astimezone(tz)
        assert moment.utcoffset() != before.utcoffset()  # it is the transition instant
        assert moment.time() > wanted > before.time()
