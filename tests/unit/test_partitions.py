"""The partition layout of ``jobs`` (issue #17): which range holds which due time."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from celery_sched.store.partitions import (
    PartitionRange,
    ahead,
    coarse_to_split,
    containing,
    parse_name,
    range_for,
    ranges_for,
)

NOW = datetime(2026, 12, 5, 17, 25, tzinfo=UTC)


def test_a_job_due_soon_lands_in_its_days_partition() -> None:
    rng = range_for(NOW + timedelta(hours=3), NOW)
    assert rng.name == "jobs_20261205_20261206"
    assert rng.grain == "day"


def test_a_job_due_in_2030_lands_in_a_yearly_partition() -> None:
    rng = range_for(datetime(2030, 6, 1, tzinfo=UTC), NOW)
    assert rng.name == "jobs_20300101_20310101"
    assert rng.grain == "year"


def test_a_job_due_in_a_few_months_lands_in_a_monthly_partition() -> None:
    rng = range_for(datetime(2027, 4, 17, 9, tzinfo=UTC), NOW)
    assert rng.name == "jobs_20270401_20270501"
    assert rng.grain == "month"


def test_a_month_touching_the_daily_band_is_cut_into_days_even_beyond_it() -> None:
    # 2027-01-05 is the edge of 31 days; the 28th of January is beyond it, but
    # its month touches the band, so it still gets a day of its own.
    rng = range_for(datetime(2027, 1, 28, tzinfo=UTC), NOW)
    assert rng.grain == "day"


def test_past_rows_get_coarse_partitions_too() -> None:
    assert range_for(datetime(2024, 3, 1, tzinfo=UTC), NOW).grain == "year"
    assert range_for(datetime(2026, 6, 1, tzinfo=UTC), NOW).grain == "month"


def test_every_due_time_falls_in_its_range_and_ranges_never_overlap() -> None:
    dues = [NOW + timedelta(hours=7 * i) for i in range(-3000, 3000)]
    ranges = ranges_for(dues, NOW)
    for due in dues:
        assert range_for(due, NOW).holds(due)
    for a, b in itertools.pairwise(ranges):
        assert a.upper <= b.lower, (a.name, b.name)


def test_bulk_insert_creates_each_range_once_oldest_first() -> None:
    dues = [
        NOW,
        NOW + timedelta(minutes=5),
        NOW + timedelta(days=1),
        datetime(2031, 1, 1, tzinfo=UTC),
    ]
    assert [r.name for r in ranges_for(dues, NOW)] == [
        "jobs_20261205_20261206",
        "jobs_20261206_20261207",
        "jobs_20310101_20320101",
    ]


def test_the_leader_creates_today_and_the_next_week_ahead() -> None:
    names = [r.name for r in ahead(NOW, days=7)]
    assert names[0] == "jobs_20261205_20261206"
    assert names[-1] == "jobs_20261212_20261213"
    assert len(names) == 8


def test_coarse_partitions_are_split_as_time_brings_them_near() -> None:
    year_2028 = range_for(datetime(2028, 5, 1, tzinfo=UTC), NOW)
    march = range_for(datetime(2027, 3, 10, tzinfo=UTC), NOW)
    today = range_for(NOW, NOW)
    existing = [year_2028, march, today]
    assert coarse_to_split(existing, NOW) == []
    later = datetime(2027, 2, 15, tzinfo=UTC)
    assert coarse_to_split(existing, later) == [march, year_2028]
    # Ranges already behind now are left whole: retention drops them.
    assert coarse_to_split([range_for(datetime(2025, 1, 1, tzinfo=UTC), NOW)], NOW) == []


def test_containing_finds_an_existing_coarser_range() -> None:
    year = range_for(datetime(2030, 1, 1, tzinfo=UTC), NOW)
    assert containing([year], datetime(2030, 8, 8, tzinfo=UTC)) == year
    assert containing([year], datetime(2031, 1, 1, tzinfo=UTC)) is None


def test_names_round_trip_and_bounds_must_be_utc() -> None:
    rng = range_for(datetime(2027, 4, 17, tzinfo=UTC), NOW)
    assert parse_name(rng.name) == rng
    with pytest.raises(ValueError):
        parse_name("ledger_20270101_20270201")
    with pytest.raises(ValueError):
        PartitionRange(lower=NOW, upper=NOW)
    with pytest.raises(ValueError):
        range_for(datetime(2027, 1, 1), NOW)  # a naive due time is refused


@pytest.mark.parametrize("year", [500, 999, 2040])
def test_names_are_fixed_width_and_read_back_as_their_range(year: int) -> None:
    """Before: ``%Y`` left year 500 unpadded (``jobs_5000101_5010101``), which
    read back as 5000-10-01 .. 5010-10-01 (#30, finding 2)."""
    rng = range_for(datetime(year, 6, 1, tzinfo=UTC), NOW)
    assert rng.name == f"jobs_{year:04d}0101_{year + 1:04d}0101"
    assert parse_name(rng.name) == rng


@pytest.mark.parametrize(
    "name",
    [
        "jobs_5000101_5010101",  # an unpadded year
        "jobs_archive",
        "jobs_20260101_20260201_old",
        "jobs_20261305_20261306",  # no 13th month
        "jobs_2026010_20260201",
        "jobs_+2026101_20260201",
    ],
)
def test_a_name_that_is_not_exactly_a_range_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match=r"not a jobs partition name|month must be"):
        parse_name(name)
