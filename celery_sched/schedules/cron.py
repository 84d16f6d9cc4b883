"""Crontab schedules: Celery's cron fields, matched on the wall clock of the
schedule's timezone (see :mod:`~celery_sched.schedules.wallclock` for DST).

``day_of_week`` and ``day_of_month`` are ANDed, as Celery's crontab does
(classic cron ORs them). Five-field cron strings and macros such as
``"@daily"`` are read here too, with cron's meaning where Celery's parser
has none: ``5/15`` (start/step: 5,20,35,50), weekday ``7`` (Sunday), and in
the day fields ``L`` (last day of the month), ``LW`` (its last weekday),
``5L`` (its last Friday) and ``1#2`` (its second Monday).

A stored crontab spec holds cron text per field. Whatever Celery's crontab
can express is stored in Celery's syntax (``5/15`` as ``5,20,35,50``,
weekday ``7`` as ``0``), so those specs stay Celery crontabs; ``L``,
``LW``, ``nL`` and ``n#k`` are stored as those cron tokens (weekday by
number), which Celery's parser refuses, so no spec written before meant
anything else by them. Reading a stored field, Celery's parser goes first
and cron's grammar reads what it refuses; reading a cron string, cron's
grammar goes first (Celery reads ``mon#2``, ``monL`` and ``mon/2`` as
plain Monday).

DST follows Vixie/Debian cron. A crontab whose minute or hour field starts
with ``*`` (``*``, ``*/15``) is a *wildcard job* (:attr:`CronSpec.wildcard`):
it runs by the new wall clock, at every real instant whose local time
matches, so through both passes of a repeated hour, and in a skipped hour
it runs what the clock reads after the jump, with no catch-up. Any other
crontab is a *fixed-time job*: a repeated local time runs once, at its first
instant, and a skipped one at the end of the gap
(:func:`~celery_sched.schedules.wallclock.wall_to_utc`). The stored text
decides, and it keeps the ``*``: ``crontab(minute="*/15")`` and
``"*/15 * * * *"`` both store ``*/15``. A crontab given a collection of
every value (``crontab(hour=range(24))``) is stored as ``*``, so it is a
wildcard job; a partial one (``range(0, 24, 6)``) is stored as
``0,6,12,18``, a fixed-time job, as ``0 0,6,12,18 * * *`` is in cron.
"""

from __future__ import annotations

import bisect
import calendar
import dataclasses
import datetime as dt
import functools
from collections.abc import Mapping
from typing import Any

from celery.schedules import crontab, crontab_parser

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

#: Each field's lowest and highest value as cron writes them (weekday 7 is
#: Sunday again), and the size Celery's parser is given.
_BOUNDS = {
    "minute": (0, 59),
    "hour": (0, 23),
    "day_of_week": (0, 7),
    "day_of_month": (1, 31),
    "month_of_year": (1, 12),
}
_CELERY_SIZES = {
    "minute": 60,
    "hour": 24,
    "day_of_week": 7,
    "day_of_month": 31,
    "month_of_year": 12,
}
_SUNDAY_FIRST = (6, 0, 1, 2, 3, 4, 5)  # calendar's weekday names start on Monday
#: The names cron's grammar accepts: abbreviated or in full, any case.
_NAMES = {
    "day_of_week": {
        name.lower(): number
        for number, day in enumerate(_SUNDAY_FIRST)
        for name in (calendar.day_abbr[day], calendar.day_name[day])
    },
    "month_of_year": {
        name.lower(): number
        for number in range(1, 13)
        for name in (calendar.month_abbr[number], calendar.month_name[number])
    },
}
# The lengths a month can have; every one occurs with every weekday on the 1st.
_LENGTHS = {
    month: (28, 29) if month == 2 else (calendar.monthrange(2001, month)[1],)
    for month in range(1, 13)
}


def cron_from_string(what: str, text: str) -> crontab:
    """The crontab of a five-field cron string (minute hour day-of-month
    month day-of-week) or a macro such as ``"@daily"``, read with cron's
    meaning: a :class:`CronString` if it uses ``L``, ``LW``, ``nL`` or
    ``n#k``, else Celery's own crontab."""
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
    return read_crontab(what, fields, cron_first=True).as_crontab()


def cron_text(original: Any, expanded: set[int], low: int, size: int) -> str:
    """The cron string of a crontab field: the user's own text when given as
    text, else the expanded values (``*`` when every value is in)."""
    if isinstance(original, str):
        return original.strip()
    if set(expanded) == set(range(low, low + size)):
        return "*"
    return ",".join(str(value) for value in sorted(expanded))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CronField:
    """One field of a crontab: its plain values and cron's day tokens."""

    text: str
    values: frozenset[int] = frozenset()
    last_day: bool = False  # L (day_of_month)
    last_weekday: bool = False  # LW (day_of_month)
    last_of: frozenset[int] = frozenset()  # 5L: weekdays on their last occurrence
    nth_of: frozenset[tuple[int, int]] = frozenset()  # 1#2: (weekday, n)

    @property
    def plain(self) -> bool:
        return not (self.last_day or self.last_weekday or self.last_of or self.nth_of)

    def candidates(self) -> list[int]:
        """Every value the field can match on some day, sorted."""
        days = set(self.values) | self.last_of | {weekday for weekday, _ in self.nth_of}
        if self.last_day:
            days |= {28, 29, 30, 31}
        if self.last_weekday:
            days |= {26, 27, 28, 29, 30, 31}
        return sorted(days)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CronSpec:
    """A crontab's five fields as :func:`read_crontab` reads them. A day
    matches when both day_of_month and day_of_week match it."""

    minute: CronField
    hour: CronField
    day_of_week: CronField  # 0 = Sunday
    day_of_month: CronField
    month_of_year: CronField

    def texts(self) -> dict[str, str]:
        return {field: getattr(self, field).text for field in CRON_FIELDS}

    @property
    def wildcard(self) -> bool:
        """Whether this is a wildcard job: its minute or hour field starts
        with ``*``, the test Vixie/Debian cron applies to the text as written
        (its ``MIN_STAR`` / ``HR_STAR`` flags), so ``0 * * * *`` and
        ``*/15 1 * * *`` are wildcard jobs and ``0,15,30,45 1 * * *`` is not."""
        return self.minute.text.lstrip().startswith("*") or self.hour.text.lstrip().startswith("*")

    def as_crontab(self, **kwargs: Any) -> crontab:
        """Celery's crontab of these fields; a :class:`CronString` if they use
        ``L``, ``LW``, ``nL`` or ``n#k``. ``kwargs`` go to the constructor."""
        if self.day_of_week.plain and self.day_of_month.plain:
            return crontab(**self.texts(), **kwargs)
        return CronString(**self.texts(), **kwargs)

    def days_of(self, first_weekday: int, length: int) -> tuple[int, ...]:
        """The matching days of a month of ``length`` days whose 1st is
        ``first_weekday`` (Monday = 0)."""
        return tuple(
            day
            for day in range(1, length + 1)
            if self._on_day(day, first_weekday, length)
            # Celery numbers weekdays from Sunday = 0.
            and self._on_weekday(day, (first_weekday + day) % 7, length)
        )

    def _on_day(self, day: int, first_weekday: int, length: int) -> bool:
        field = self.day_of_month
        if day in field.values or (field.last_day and day == length):
            return True
        return field.last_weekday and day == _last_weekday(first_weekday, length)

    def _on_weekday(self, day: int, weekday: int, length: int) -> bool:
        field = self.day_of_week
        return (
            weekday in field.values
            or (weekday in field.last_of and day + 7 > length)
            or (weekday, (day + 6) // 7) in field.nth_of
        )


def _last_weekday(first_weekday: int, length: int) -> int:
    """The last Monday-to-Friday day of a month (1st on ``first_weekday``, Monday = 0)."""
    last = (first_weekday + length - 1) % 7  # Monday = 0
    if last == calendar.SATURDAY:
        return length - 1
    if last == calendar.SUNDAY:
        return length - 2
    return length


def read_crontab(what: str, fields: Mapping[str, Any], *, cron_first: bool = False) -> CronSpec:
    """The five fields of a crontab, read; InvalidSchedule names the bad
    field and the problem, or says the crontab never fires.

    A stored field is read by Celery's parser first (so a stored spec keeps
    its meaning) and by cron's grammar where Celery refuses an item;
    ``cron_first`` (a cron string) reverses that."""
    read: dict[str, CronField] = {}
    for field in CRON_FIELDS:
        text = str(fields[field])
        try:
            read[field] = _read_field(field, text, cron_first=cron_first)
        except ValueError as exc:
            raise InvalidSchedule(
                f"{what}: invalid crontab field {field}={text!r}: {exc}"
            ) from None
    cron = CronSpec(**read)
    if not any(
        cron.days_of(first_weekday, length)
        for month in cron.month_of_year.values
        for length in _LENGTHS[month]
        for first_weekday in range(7)
    ):
        raise InvalidSchedule(
            f"{what}: crontab never fires: no day of month_of_year="
            f"{cron.month_of_year.text!r} matches both day_of_month="
            f"{cron.day_of_month.text!r} and day_of_week={cron.day_of_week.text!r}"
        )
    return cron


def _read_field(field: str, text: str, *, cron_first: bool) -> CronField:
    items = [_read_item(field, item, cron_first=cron_first) for item in text.split(",")]
    joined = ",".join(item.text for item in items)
    return CronField(
        text=text.strip() if joined == text else joined,
        values=frozenset().union(*(item.values for item in items)),
        last_day=any(item.last_day for item in items),
        last_weekday=any(item.last_weekday for item in items),
        last_of=frozenset().union(*(item.last_of for item in items)),
        nth_of=frozenset().union(*(item.nth_of for item in items)),
    )


def _read_item(field: str, item: str, *, cron_first: bool) -> CronField:
    """One comma-separated item. Its text stays as written where Celery's
    parser reads it as meant; else it is rewritten as cron tokens (``5L``)
    or values Celery's parser reads (``5/15`` as ``5,20,35,50``)."""
    celery = _celery_values(field, item)
    if celery is not None and not cron_first:
        return CronField(text=item, values=celery)
    try:
        ours = _cron_item(field, item)
    except ValueError:
        if celery is None or _misread_by_celery(field, item):
            raise
        return CronField(text=item, values=celery)
    if ours.plain and ours.values == celery:
        return CronField(text=item, values=celery)
    return ours


def _misread_by_celery(field: str, item: str) -> bool:
    """Whether Celery's parser would take a cron token for something else
    (``mon#2``, ``monL``, ``mon/2`` all read as Monday)."""
    head, slash, _ = item.partition("/")
    return (
        "#" in item
        or (field == "day_of_week" and item.upper().endswith("L"))
        or (bool(slash) and head != "*" and "-" not in head)
    )


def _celery_values(field: str, item: str) -> frozenset[int] | None:
    try:
        return frozenset(crontab_parser(_CELERY_SIZES[field], _BOUNDS[field][0]).parse(item))
    except Exception:  # Celery raises ValueError, TypeError or ParseException
        return None


def _cron_item(field: str, item: str) -> CronField:
    """One item read with cron's meaning; ValueError names the problem."""
    upper = item.upper()
    if field == "day_of_month" and upper in ("L", "LW"):
        return CronField(text=upper, last_day=upper == "L", last_weekday=upper == "LW")
    if field == "day_of_week" and "#" in item:
        day, _, nth = item.partition("#")
        weekday = _weekday(day, item)
        if not nth.isdigit() or not 1 <= int(nth) <= 5:
            raise ValueError(
                f"{item!r}: the k of n#k must be 1 to 5 (a weekday occurs at most 5 times a month)"
            )
        return CronField(text=f"{weekday}#{int(nth)}", nth_of=frozenset({(weekday, int(nth))}))
    if field == "day_of_week" and upper.endswith("L"):
        weekday = _weekday(item[:-1], item)
        return CronField(text=f"{weekday}L", last_of=frozenset({weekday}))
    values = _cron_values(field, item)
    return CronField(text=",".join(str(value) for value in values), values=frozenset(values))


def _weekday(text: str, item: str) -> int:
    if not text:
        raise ValueError(f"{item!r} needs a weekday before it, e.g. 5L (the last Friday)")
    return _value("day_of_week", text) % 7


def _cron_values(field: str, item: str) -> list[int]:
    """The values of ``*``, ``a``, ``a-b``, each optionally ``/step``
    (``a/step`` runs from ``a`` to the field's end), sorted."""
    low, high = _BOUNDS[field]
    head, slash, step_text = item.partition("/")
    step = 1
    if slash:
        if not step_text.isdigit() or int(step_text) < 1:
            raise ValueError(f"step {step_text!r} must be a whole number of at least 1")
        step = int(step_text)
    if head == "*":
        first, last = low, (6 if field == "day_of_week" else high)
    elif "-" in head:
        start, _, end = head.partition("-")
        first, last = _value(field, start), _value(field, end)
        if last < first:
            raise ValueError(f"range {head!r} runs backwards")
    else:
        first = _value(field, head)
        last = high if slash else first
    return sorted(
        {value % 7 if field == "day_of_week" else value for value in range(first, last + 1, step)}
    )


def _value(field: str, text: str) -> int:
    """One number or name of ``field``; ValueError says why not."""
    low, high = _BOUNDS[field]
    if text.isdigit():
        if not low <= int(text) <= high:
            raise ValueError(f"{int(text)} is out of range {low}-{high}")
        return int(text)
    number = _NAMES.get(field, {}).get(text.lower())
    if number is None:
        raise ValueError(_not_a_value(field, text))
    return number


def _not_a_value(field: str, text: str) -> str:
    upper = text.upper()
    if field == "day_of_month" and ("L" in upper or "W" in upper):
        return f"{text!r}: day_of_month takes L (last day) or LW (last weekday) alone"
    if field == "day_of_week" and "W" in upper:
        return f"{text!r}: W goes in day_of_month only, as LW"
    if "L" in upper or "W" in upper or "#" in upper:
        return (
            f"{text!r}: L, W and # go in the day fields only "
            "(day_of_month L or LW, day_of_week 5L or 1#2)"
        )
    kind = {"day_of_week": " or a weekday name", "month_of_year": " or a month name"}
    return f"{text!r} is not a number{kind.get(field, '')}"


class CronString(crontab):
    """A crontab with cron's ``L``, ``LW``, ``nL`` or ``n#k``, which Celery's
    crontab lacks. Its fields keep the cron text (Celery's expanded sets
    hold every value they can match); it is evaluated by celery_sched's
    rules, under stock beat too."""

    def __init__(
        self,
        minute: Any = "*",
        hour: Any = "*",
        day_of_week: Any = "*",
        day_of_month: Any = "*",
        month_of_year: Any = "*",
        **kwargs: Any,
    ) -> None:
        texts = dict(
            zip(CRON_FIELDS, (minute, hour, day_of_week, day_of_month, month_of_year), strict=True)
        )
        self.cron = read_crontab("crontab", texts)
        super().__init__(
            **{field: getattr(self.cron, field).candidates() for field in CRON_FIELDS}, **kwargs
        )
        for field, text in self.cron.texts().items():
            setattr(self, f"_orig_{field}", text)

    def remaining_estimate(self, last_run_at: dt.datetime, ffwd: Any = None) -> dt.timedelta:
        zone: Any = self.tz
        after = self.maybe_make_aware(last_run_at).astimezone(UTC)
        moment = CompiledCron(self.cron.texts(), zone).next_after(after)
        if moment is None:
            return dt.timedelta.max
        return moment - self.now().astimezone(UTC)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CronString) and other.cron == self.cron and super().__eq__(other)


class CompiledCron(Compiled):
    """A crontab on the wall clock of a zone, with Celery's field semantics
    and cron's DST rules for wildcard and fixed-time jobs (module docstring)."""

    probe = 2 * MINUTE

    def __init__(self, fields: Mapping[str, Any], zone: dt.tzinfo) -> None:
        self.cron = read_crontab("crontab", fields)
        self.minutes = sorted(self.cron.minute.values)
        self.hours = sorted(self.cron.hour.values)
        self.months = sorted(self.cron.month_of_year.values)
        self.month_set = frozenset(self.months)
        self.zone = zone
        self.clock = WallClock(zone)
        self.wildcard = self.cron.wildcard
        self.per_day = len(self.minutes) * len(self.hours)
        # The matching days of each shape of month (28 at most).
        self._days: dict[tuple[int, int], tuple[int, ...]] = {}

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        zone = self.zone
        local = after if zone is UTC else after.astimezone(zone)
        try:
            here = dt.datetime(local.year, local.month, local.day, local.hour, local.minute)
            wall = here + MINUTE
            if not self.wildcard:
                return self._next_fixed_time(after, wall)
            found = self._next_real(after, wall, second_pass=False)
            if zone is UTC or self.clock.day_offset(here) is not None:
                return found
            if local.replace(fold=1 - local.fold).utcoffset() == local.utcoffset():
                return found
            # `after` lies in a repeated hour. The walk above takes each wall
            # time's first pass, but the second pass of wall times already
            # behind `after` may still be ahead of it: walk the second-pass
            # readings too, from `after`'s wall time on the second pass's
            # offset (in the second pass that is `here`).
            second_offset = local.replace(fold=1).utcoffset()
            assert second_offset is not None
            start = (after + second_offset).replace(tzinfo=None, second=0, microsecond=0)
            repeat = self._next_real(after, start + MINUTE, second_pass=True)
            if found is None or repeat is None:
                return found or repeat
            return min(found, repeat)
        except OverflowError:  # past year 9999
            return None

    def _next_fixed_time(self, after: dt.datetime, wall: dt.datetime) -> dt.datetime | None:
        """The first instant after ``after`` of a matching wall time at or after
        ``wall``, each wall time read once (:func:`wall_to_utc`)."""
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

    def _next_real(
        self, after: dt.datetime, wall: dt.datetime, *, second_pass: bool
    ) -> dt.datetime | None:
        """The first instant after ``after`` at which the clock reads a
        matching wall time at or after ``wall``, taking each wall time's
        first instant (``second_pass``: its last); wall times in a gap have
        none. Either reading alone grows with the wall time."""
        while True:
            found = self._next_wall(wall)
            if found is None:
                return None
            instants = self.clock.instants(found)
            if instants:
                instant = instants[-1] if second_pass else instants[0]
                if instant > after:
                    return instant
            wall = found + MINUTE

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
        shape = _month_shape(year, month)
        days = self._days.get(shape)
        if days is None:
            days = self._days[shape] = self.cron.days_of(*shape)
        index = bisect.bisect_left(days, day)
        return days[index] if index < len(days) else None

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
