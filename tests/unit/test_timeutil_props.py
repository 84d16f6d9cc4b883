"""Properties of local-time resolution and minute buckets around DST and leap days."""

from __future__ import annotations

import datetime as dt
import zoneinfo

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from celery_sched.errors import AmbiguousTime, NonExistentTime
from celery_sched.timeutil import (
    UTC,
    bucket_start,
    from_epoch_seconds,
    resolve_local,
    to_bucket,
    to_epoch_seconds,
)

ZONES = ["America/New_York", "Europe/London", "Australia/Lord_Howe", "Asia/Kolkata"]

naive_times = st.datetimes(
    min_value=dt.datetime(1990, 1, 1), max_value=dt.datetime(2060, 12, 31, 23, 59, 59)
)
aware_times = st.datetimes(
    min_value=dt.datetime(1971, 1, 1),
    max_value=dt.datetime(2100, 1, 1),
    timezones=st.just(UTC),
)


def _offsets(value: dt.datetime, zone: dt.tzinfo) -> set[dt.timedelta | None]:
    return {value.replace(tzinfo=zone, fold=fold).utcoffset() for fold in (0, 1)}


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(ZONES), value=naive_times)
# New York: spring-forward gap and fall-back overlap.
@example(name="America/New_York", value=dt.datetime(2024, 3, 10, 2, 30))
@example(name="America/New_York", value=dt.datetime(2024, 11, 3, 1, 30))
# London: gap 01:00-02:00 in March, overlap 01:00-02:00 in October.
@example(name="Europe/London", value=dt.datetime(2024, 3, 31, 1, 15))
@example(name="Europe/London", value=dt.datetime(2024, 10, 27, 1, 59, 59))
# Lord Howe shifts by only 30 minutes.
@example(name="Australia/Lord_Howe", value=dt.datetime(2024, 10, 6, 2, 15))
@example(name="Australia/Lord_Howe", value=dt.datetime(2024, 4, 7, 1, 45))
# Kolkata has no DST at all.
@example(name="Asia/Kolkata", value=dt.datetime(2024, 2, 29, 23, 59))
def test_resolve_local_raises_the_right_error_or_round_trips(name: str, value: dt.datetime) -> None:
    zone = zoneinfo.ZoneInfo(name)
    offsets = _offsets(value, zone)
    try:
        resolved = resolve_local(value, zone)
    except NonExistentTime:
        # Skipped wall time: no offset maps it back to itself.
        assert len(offsets) == 2
        for fold in (0, 1):
            candidate = value.replace(tzinfo=zone, fold=fold).astimezone(UTC)
            assert candidate.astimezone(zone).replace(tzinfo=None) != value
        return
    except AmbiguousTime:
        # Repeated wall time: both offsets map back to it, at different instants.
        assert len(offsets) == 2
        instants = {value.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1)}
        assert len(instants) == 2
        for instant in instants:
            assert instant.astimezone(zone).replace(tzinfo=None) == value
        return
    assert len(offsets) == 1
    assert resolved.tzinfo is UTC
    assert resolved.astimezone(zone).replace(tzinfo=None) == value


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        ("America/New_York", dt.datetime(2024, 3, 10, 2, 0), NonExistentTime),
        ("America/New_York", dt.datetime(2024, 11, 3, 1, 0), AmbiguousTime),
        ("Europe/London", dt.datetime(2024, 3, 31, 1, 30), NonExistentTime),
        ("Europe/London", dt.datetime(2024, 10, 27, 1, 30), AmbiguousTime),
        ("Australia/Lord_Howe", dt.datetime(2024, 10, 6, 2, 0), NonExistentTime),
        ("Australia/Lord_Howe", dt.datetime(2024, 4, 7, 1, 30), AmbiguousTime),
    ],
)
def test_known_transitions(name: str, value: dt.datetime, error: type[Exception]) -> None:
    with pytest.raises(error):
        resolve_local(value, zoneinfo.ZoneInfo(name))


def test_edges_of_a_gap_resolve() -> None:
    zone = zoneinfo.ZoneInfo("America/New_York")
    before = resolve_local(dt.datetime(2024, 3, 10, 1, 59, 59), zone)
    after = resolve_local(dt.datetime(2024, 3, 10, 3, 0), zone)
    assert after - before == dt.timedelta(seconds=1)


def test_aware_values_pass_through_as_utc() -> None:
    value = dt.datetime(2024, 3, 10, 2, 30, tzinfo=dt.timezone(dt.timedelta(hours=-5)))
    assert resolve_local(value, zoneinfo.ZoneInfo("America/New_York")) == value
    assert resolve_local(value, zoneinfo.ZoneInfo("America/New_York")).tzinfo is UTC


# -- buckets -------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(value=aware_times)
def test_bucket_contains_its_instant(value: dt.datetime) -> None:
    bucket = to_bucket(value)
    start = bucket_start(bucket)
    assert start <= value < start + dt.timedelta(minutes=1)
    assert to_bucket(start) == bucket
    assert start.second == 0 and start.microsecond == 0


@settings(max_examples=300, deadline=None)
@given(a=aware_times, b=aware_times)
def test_buckets_are_monotonic(a: dt.datetime, b: dt.datetime) -> None:
    if a <= b:
        assert to_bucket(a) <= to_bucket(b)
    else:
        assert to_bucket(a) >= to_bucket(b)


@settings(max_examples=300, deadline=None)
@given(bucket=st.integers(min_value=0, max_value=70_000_000))
def test_bucket_start_round_trips(bucket: int) -> None:
    assert to_bucket(bucket_start(bucket)) == bucket
    assert to_bucket(bucket_start(bucket) - dt.timedelta(microseconds=1)) == bucket - 1


@settings(max_examples=200, deadline=None)
@given(
    day=st.dates(min_value=dt.date(1972, 1, 1), max_value=dt.date(2099, 12, 31)),
)
@example(day=dt.date(2024, 2, 29))
@example(day=dt.date(2000, 2, 29))
@example(day=dt.date(2024, 3, 10))  # New York spring forward
@example(day=dt.date(2024, 10, 27))  # London fall back
def test_every_utc_day_has_1440_buckets(day: dt.date) -> None:
    start = dt.datetime.combine(day, dt.time(), tzinfo=UTC)
    end = start + dt.timedelta(days=1)
    assert to_bucket(end) - to_bucket(start) == 1440
    assert to_bucket(end - dt.timedelta(microseconds=1)) == to_bucket(start) + 1439


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(ZONES),
    value=st.datetimes(
        min_value=dt.datetime(2000, 1, 1),
        max_value=dt.datetime(2050, 1, 1),
        timezones=st.just(UTC),
    ),
    minutes=st.integers(min_value=0, max_value=60 * 24 * 400),
)
def test_buckets_follow_utc_not_wall_clock(name: str, value: dt.datetime, minutes: int) -> None:
    # Whatever zone a time is expressed in, and across any DST change in
    # between, bucket distance equals elapsed minutes.
    zone = zoneinfo.ZoneInfo(name)
    later = value + dt.timedelta(minutes=minutes)
    assert to_bucket(later.astimezone(zone)) - to_bucket(value.astimezone(zone)) == minutes


@settings(max_examples=200, deadline=None)
@given(year=st.integers(min_value=1972, max_value=2400))
@example(year=2000)
@example(year=2100)
@example(year=2024)
def test_february_has_one_extra_day_of_buckets_in_leap_years(year: int) -> None:
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    feb1 = dt.datetime(year, 2, 1, tzinfo=UTC)
    mar1 = dt.datetime(year, 3, 1, tzinfo=UTC)
    assert to_bucket(mar1) - to_bucket(feb1) == 1440 * (29 if leap else 28)
    if leap:
        feb29 = dt.datetime(year, 2, 29, tzinfo=UTC)
        assert bucket_start(to_bucket(feb29) + 1440) == mar1


@settings(max_examples=300, deadline=None)
@given(value=aware_times)
def test_epoch_seconds_round_trip(value: dt.datetime) -> None:
    # A float holds epoch seconds to well under a microsecond in this range.
    assert abs(from_epoch_seconds(to_epoch_seconds(value)) - value) <= dt.timedelta(microseconds=1)
