"""Clocked schedules: one instant, usable in ``beat_schedule`` too.

The module is not called ``clocked`` because :class:`clocked` is public as
``celery_sched.schedules.clocked``; a submodule of that name would shadow it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from celery.schedules import BaseSchedule, schedstate

from celery_sched.errors import InvalidSchedule
from celery_sched.schedules.compiled import Compiled
from celery_sched.schedules.wallclock import DAY
from celery_sched.timeutil import UTC, resolve_local


class clocked(BaseSchedule):  # noqa: N801  (named like Celery's schedule classes)
    """A one-off schedule: fires once, at ``at``.

    ``at`` is an aware datetime, a naive one (read as wall-clock time in the
    schedule's timezone, which defaults to the app's, as Celery reads a naive
    eta), or an ISO 8601 string. A naive time that is ambiguous or does not
    exist there raises :class:`~celery_sched.errors.AmbiguousTime` or
    :class:`~celery_sched.errors.NonExistentTime` when it is resolved.

    Stock beat can run it too: it is due once ``at`` has passed, unless the
    entry last ran at or after ``at`` (beat records the start time as the
    first "last run", so a one-off whose time passed before beat started does
    not fire, like ``misfire="skip"``).
    """

    def __init__(
        self,
        at: dt.datetime | str,
        nowfun: Any = None,
        app: Any = None,
    ) -> None:
        if isinstance(at, str):
            try:
                at = dt.datetime.fromisoformat(at)
            except ValueError as exc:
                raise InvalidSchedule(f"clocked time is not ISO 8601: {at!r}") from exc
        if not isinstance(at, dt.datetime):
            raise InvalidSchedule(f"clocked time must be a datetime, got {type(at).__name__}")
        if at.tzinfo is not None and at.utcoffset() is not None:
            at = at.astimezone(UTC)
        else:
            at = at.replace(tzinfo=None)
        self.at = at
        super().__init__(nowfun=nowfun, app=app)

    def at_utc(self, zone: dt.tzinfo | None = None) -> dt.datetime:
        """``at`` as an aware UTC instant; a naive ``at`` is read in ``zone``
        (default: the app's timezone). Raises AmbiguousTime / NonExistentTime."""
        if self.at.tzinfo is not None:
            return self.at
        app_zone: dt.tzinfo = self.tz  # type: ignore[assignment]  # stubs say str
        return resolve_local(self.at, app_zone if zone is None else zone)

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        now: dt.datetime = self.maybe_make_aware(self.now())
        return self.at_utc() - now

    def is_due(self, last_run_at: dt.datetime) -> schedstate:
        """Due once ``at`` has passed and the entry has not run since ``at``."""
        at = self.at_utc()
        last: dt.datetime = self.maybe_make_aware(last_run_at)
        now: dt.datetime = self.maybe_make_aware(self.now())
        if last >= at:
            return schedstate(is_due=False, next=3600.0)  # done; nothing to wait for
        if now >= at:
            return schedstate(is_due=True, next=3600.0)
        return schedstate(is_due=False, next=(at - now).total_seconds())

    def __repr__(self) -> str:
        return f"<clocked: {self.at.isoformat()}>"

    def __reduce__(self) -> tuple[type[clocked], tuple[dt.datetime, Any]]:
        return self.__class__, (self.at, getattr(self, "nowfun", None))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, clocked):
            return self.at == other.at
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.at)


# Public as celery_sched.schedules.clocked: beat pickles schedule objects
# (its shelve file), and a pickle names the class by module.
clocked.__module__ = "celery_sched.schedules"


class CompiledClocked(Compiled):
    """A clocked schedule: ``at`` and nothing after."""

    probe = 366 * DAY

    def __init__(self, at: dt.datetime) -> None:
        self.at = at

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        return self.at if self.at > after else None


def format_utc(value: dt.datetime) -> str:
    """A clocked spec's time: ISO 8601 UTC with a ``Z``."""
    return value.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"


def parse_utc(text: str) -> dt.datetime:
    """The instant of a clocked spec's time; ValueError without an offset."""
    value = dt.datetime.fromisoformat(text)
    if value.tzinfo is None:
        raise ValueError("a clocked spec's time must carry its offset (…Z)")
    return value.astimezone(UTC)
