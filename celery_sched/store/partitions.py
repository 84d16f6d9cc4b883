"""Where a job row lives in a range-partitioned ``jobs`` table (issue #17).

Pure layout arithmetic, no I/O: the store and the leader's housekeeping ask it
which partition holds a due time, and which coarse partitions must be split now
that time has moved on.

The layout:

- a *daily* partition for every UTC day whose whole span lies within
  ``daily_horizon`` of now (either side: rows inserted by a migration or a late
  ``schedule()`` can be due in the past);
- a *monthly* partition for a calendar month entirely outside the daily band
  but within ``monthly_horizon``;
- a *yearly* partition for a calendar year entirely outside both, so a job due
  in 2030 lands in ``jobs_20300101_20310101`` and costs one table, not 1500.

PostgreSQL 15 has no ``SPLIT PARTITION``, and a DEFAULT partition would have
to be scanned whenever a new partition overlapping its rows is attached; so
there is no DEFAULT partition: every insert first makes sure its range exists
(:func:`ranges_for`), and a coarse partition that time has brought into a finer
band is split by the leader (:func:`coarse_to_split`): detach it, create the
finer ranges, move its rows, drop it.

A range never changes once created, so two beats computing the layout at
slightly different instants can disagree only about a coarse range that the
next split resolves; ``CREATE TABLE ... PARTITION OF`` for a range that overlaps
an existing one fails, and the caller then uses the existing partition
(:func:`containing`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

#: Days within this distance of now get daily partitions.
DAILY_HORIZON = timedelta(days=31)
#: Months entirely within this distance of now (and outside the daily band)
#: get monthly partitions; beyond it, yearly ones.
MONTHLY_HORIZON = timedelta(days=366)


@dataclass(frozen=True, kw_only=True, order=True)
class PartitionRange:
    """A half-open range ``[lower, upper)`` of due times held by one partition."""

    lower: datetime
    upper: datetime

    def __post_init__(self) -> None:
        for bound in (self.lower, self.upper):
            if bound.utcoffset() != timedelta(0):
                raise ValueError(f"partition bounds must be UTC, got {bound!r}")
        if self.upper <= self.lower:
            raise ValueError(f"empty partition range {self.lower} .. {self.upper}")

    @property
    def name(self) -> str:
        """Table name, e.g. ``jobs_20261205_20261206``; sorts by time.

        Fixed width (``%Y`` does not pad a year before 1000, and such a name
        read back as another range)."""
        return f"jobs_{_stamp(self.lower)}_{_stamp(self.upper)}"

    @property
    def grain(self) -> str:
        """``day``, ``month`` or ``year``."""
        if self.upper - self.lower == timedelta(days=1):
            return "day"
        if self.lower.month == 1 and self.upper.year == self.lower.year + 1:
            return "year"
        return "month"

    def holds(self, due_at: datetime) -> bool:
        return self.lower <= due_at < self.upper


def _stamp(at: datetime) -> str:
    return f"{at.year:04d}{at.month:02d}{at.day:02d}"


def _day(at: datetime) -> datetime:
    at = at.astimezone(UTC)
    return datetime(at.year, at.month, at.day, tzinfo=UTC)


def _month(at: datetime) -> PartitionRange:
    at = at.astimezone(UTC)
    lower = datetime(at.year, at.month, 1, tzinfo=UTC)
    upper = datetime(at.year + at.month // 12, at.month % 12 + 1, 1, tzinfo=UTC)
    return PartitionRange(lower=lower, upper=upper)


def _year(at: datetime) -> PartitionRange:
    at = at.astimezone(UTC)
    return PartitionRange(
        lower=datetime(at.year, 1, 1, tzinfo=UTC), upper=datetime(at.year + 1, 1, 1, tzinfo=UTC)
    )


def _within(rng: PartitionRange, now: datetime, horizon: timedelta) -> bool:
    """Whether any instant of ``rng`` lies within ``horizon`` of ``now``."""
    return rng.lower <= now + horizon and rng.upper > now - horizon


def range_for(
    due_at: datetime,
    now: datetime,
    *,
    daily_horizon: timedelta = DAILY_HORIZON,
    monthly_horizon: timedelta = MONTHLY_HORIZON,
) -> PartitionRange:
    """The partition range that should hold a row due at ``due_at``, as of ``now``.

    A month that touches the daily band is cut into days (each day then falls
    in the band or not by itself: days of such a month outside the band still
    get daily partitions, so the month is never half coarse, half fine).
    """
    if due_at.utcoffset() is None or now.utcoffset() is None:
        raise ValueError("due_at and now must be timezone-aware")
    year = _year(due_at)
    if not _within(year, now, monthly_horizon):
        return year
    month = _month(due_at)
    if not _within(month, now, daily_horizon):
        return month
    lower = _day(due_at)
    return PartitionRange(lower=lower, upper=lower + timedelta(days=1))


def ranges_for(
    due_times: Iterable[datetime],
    now: datetime,
    *,
    daily_horizon: timedelta = DAILY_HORIZON,
    monthly_horizon: timedelta = MONTHLY_HORIZON,
) -> list[PartitionRange]:
    """The distinct ranges a bulk insert needs, oldest first (created before the COPY)."""
    found = {
        range_for(d, now, daily_horizon=daily_horizon, monthly_horizon=monthly_horizon)
        for d in due_times
    }
    return sorted(found)


def ahead(
    now: datetime, *, days: int = 7, daily_horizon: timedelta = DAILY_HORIZON
) -> list[PartitionRange]:
    """The ranges the leader creates ahead of time: today and the next ``days`` days."""
    start = _day(now)
    return ranges_for(
        (start + timedelta(days=i) for i in range(days + 1)), now, daily_horizon=daily_horizon
    )


def containing(existing: Iterable[PartitionRange], due_at: datetime) -> PartitionRange | None:
    """The existing partition that holds ``due_at``, if any."""
    for rng in existing:
        if rng.holds(due_at):
            return rng
    return None


def coarse_to_split(
    existing: Iterable[PartitionRange],
    now: datetime,
    *,
    daily_horizon: timedelta = DAILY_HORIZON,
    monthly_horizon: timedelta = MONTHLY_HORIZON,
) -> list[PartitionRange]:
    """Existing yearly/monthly partitions that time has brought into a finer band.

    Only ranges ahead of now are split: a coarse range in the past holds rows
    that are due already (claimed by the sweep from wherever they are) or
    finished (retired by dropping the whole range), so cutting it buys nothing.
    """
    out = []
    for rng in existing:
        if rng.grain == "day" or rng.upper <= now:
            continue
        wanted = range_for(
            max(rng.lower, now), now, daily_horizon=daily_horizon, monthly_horizon=monthly_horizon
        )
        if wanted != rng:
            out.append(rng)
    return sorted(out)


_NAME = re.compile(r"jobs_(\d{4})(\d{2})(\d{2})_(\d{4})(\d{2})(\d{2})")


def parse_name(name: str) -> PartitionRange:
    """The range of a partition table named by :attr:`PartitionRange.name`;
    ValueError for any other name (exactly two dates of eight digits)."""
    found = _NAME.fullmatch(name)
    if found is None:
        raise ValueError(f"not a jobs partition name: {name!r}")
    y1, m1, d1, y2, m2, d2 = map(int, found.groups())
    # datetime() refuses a date that does not exist (ValueError too).
    return PartitionRange(
        lower=datetime(y1, m1, d1, tzinfo=UTC), upper=datetime(y2, m2, d2, tzinfo=UTC)
    )
