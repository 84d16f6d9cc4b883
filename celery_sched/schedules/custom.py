"""Custom schedule classes: any object beat drives through ``is_due``.

Stock beat keeps a ``last_run_at`` per entry and asks the schedule object
``is_due(last_run_at)``, which answers ``(due, seconds until the next
check)``; beat runs the entry when ``due`` and sets ``last_run_at`` to the
time it ran. :class:`CompiledCustom` asks the same question on a simulated
clock, so the planner can materialize the instants ahead of time: the next
instant after ``t`` is the first check, starting at ``t`` with
``last_run_at = t``, at which the object says it is due.

Such an object lives only in the code. The stored row records its class and
repr for display (:func:`custom_definition`); the planner of every beat
evaluates it from the object it got from ``beat_schedule`` or the decorator,
carried by the spec's :class:`CustomDefinition` (a plain dict read back from
the store has none, and does not evaluate).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import re
import threading
from collections.abc import Callable
from typing import Any

from celery_sched.errors import InvalidSchedule
from celery_sched.schedules.compiled import Compiled

__all__ = [
    "MAX_CHECKS",
    "CompiledCustom",
    "CustomDefinition",
    "custom_definition",
    "is_custom_schedule",
]

#: The most ``is_due`` calls one instant may take before the object is
#: refused as never due (with waits of an hour, more than a year ahead).
MAX_CHECKS = 10_000
#: What beat waits when ``is_due`` gives no number of seconds (its default
#: ``max_interval``, ``celery.beat.DEFAULT_MAX_INTERVAL``).
DEFAULT_MAX_INTERVAL = 300.0
#: The least the simulated clock moves between two checks: an object that
#: keeps answering "not due, check again in 0 s" still lets time pass, as
#: it does under beat, until :data:`MAX_CHECKS` refuses it.
MIN_STEP = dt.timedelta(milliseconds=1)
_REPR_LIMIT = 200
# A default repr's address changes with every process start; left in, every
# election would see a changed definition and restart the schedule.
_ADDRESS = re.compile(r" at 0x[0-9A-Fa-f]+")


def is_custom_schedule(value: object) -> bool:
    """Whether beat could drive ``value``: it has a callable ``is_due``."""
    return callable(getattr(value, "is_due", None))


class CustomDefinition(dict[str, Any]):
    """The definition of a custom schedule: ``{"class": "<module>.<qualname>",
    "repr": "..."}`` as stored, plus the schedule object, which is never
    stored (``dict(definition)`` drops it)."""

    def __init__(self, schedule: object, *, max_interval: float) -> None:
        super().__init__(custom_definition(schedule))
        self.schedule = schedule
        self.max_interval = max_interval
        self._compiled: dict[str, CompiledCustom] = {}
        self._lock = threading.Lock()

    def compiled(self, name: str, zone: dt.tzinfo, zone_name: str) -> CompiledCustom:
        """The evaluator of this object in ``zone`` (one per zone)."""
        with self._lock:
            found = self._compiled.get(zone_name)
            if found is None:
                found = CompiledCustom(
                    self.schedule, zone=zone, max_interval=self.max_interval, name=name
                )
                self._compiled[zone_name] = found
            return found


def custom_definition(schedule: object) -> dict[str, str]:
    """The stored (JSON) definition of a custom schedule object."""
    cls = type(schedule)
    try:
        shown = repr(schedule)
    except Exception as exc:  # a user's __repr__; the row only displays it
        shown = f"<{cls.__name__}: repr failed: {type(exc).__name__}>"
    shown = _ADDRESS.sub("", shown)
    if len(shown) > _REPR_LIMIT:
        shown = shown[: _REPR_LIMIT - 3] + "..."
    return {"class": f"{cls.__module__}.{cls.__qualname__}", "repr": shown}


class CompiledCustom(Compiled):
    """A custom schedule object asked, as beat asks it, on a simulated clock.

    ``next_after(t)`` starts a clock at ``t`` and calls
    ``is_due(last_run_at=t)``; while the answer is "not due", the clock
    moves on by the seconds the answer gives (beat's ``max_interval`` if it
    gives no number) and asks again. The first check after ``t`` that
    answers "due" is the instant. That is the check beat makes: after a run
    at ``t`` it asks again once the wait of the answer has passed, which is
    the wait ``is_due(t)`` gives at ``t`` for every schedule whose answer
    depends only on ``last_run_at`` and the time (Celery's own schedules
    and the usual subclasses). Beat's 10 ms early wake-up is left out: it
    only adds a check.

    The clock reaches the object through ``nowfun`` (what
    :meth:`celery.schedules.BaseSchedule.now` reads) and ``now`` of a copy;
    instants are passed aware, in the schedule's timezone, as ``app.now()``
    gives them to beat. An object that reads the time some other way
    (``datetime.now()`` inside ``is_due``) cannot be simulated: its instants
    depend on when the planner runs. Such an object without ``nowfun`` or
    ``now`` is refused; one that has them but ignores them is not detected.

    Bounded: at most :data:`MAX_CHECKS` checks per instant, then
    InvalidSchedule. An answer the object gives with an exception, or in a
    shape beat could not use, raises InvalidSchedule naming the schedule.
    """

    def __init__(
        self, schedule: object, *, zone: dt.tzinfo, max_interval: float, name: str
    ) -> None:
        self.label = f"schedule {name!r} ({custom_definition(schedule)['class']})"
        self.zone = zone
        self.max_interval = dt.timedelta(seconds=max_interval)
        self._clock = dt.datetime.min.replace(tzinfo=dt.UTC)
        self._lock = threading.Lock()
        self._is_due = self._drive(schedule).is_due

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        with self._lock:
            return self._next_after(after)

    def _next_after(self, after: dt.datetime) -> dt.datetime | None:
        last = after.astimezone(self.zone)
        clock = after
        for _ in range(MAX_CHECKS):
            due, wait = self._ask(last, clock)
            if due and clock > after:
                return clock
            try:
                clock += max(wait, MIN_STEP)
            except OverflowError:
                return None  # not due before the year 9999
        raise InvalidSchedule(
            f"{self.label} was not due within {MAX_CHECKS} checks after "
            f"{after:%Y-%m-%dT%H:%M:%S}Z (reached {clock:%Y-%m-%dT%H:%M:%S}Z): its is_due "
            "never answers True; celery_sched plans occurrences ahead and refuses a schedule "
            "it cannot find the next one of"
        )

    def _ask(self, last: dt.datetime, clock: dt.datetime) -> tuple[bool, dt.timedelta]:
        self._clock = clock
        try:
            answer = self._is_due(last)
        except Exception as exc:  # the user's code: its error is this schedule's
            raise InvalidSchedule(
                f"{self.label}: is_due({last.isoformat()}) raised {type(exc).__name__}: {exc}"
            ) from exc
        try:
            due, wait = answer
        except (TypeError, ValueError):
            raise InvalidSchedule(
                f"{self.label}: is_due returned {answer!r}; expected (is_due, "
                "seconds until the next check), as celery.schedules.schedstate"
            ) from None
        return bool(due), self._wait(wait)

    def _wait(self, wait: object) -> dt.timedelta:
        """The answer's wait as beat reads it: seconds, or ``max_interval``."""
        if isinstance(wait, dt.timedelta):
            return wait
        if isinstance(wait, (int, float)) and not isinstance(wait, bool) and math.isfinite(wait):
            try:
                return dt.timedelta(seconds=wait)
            except OverflowError:
                return dt.timedelta.max
        return self.max_interval

    def _now(self) -> dt.datetime:
        return self._clock.astimezone(self.zone)

    def _drive(self, schedule: object) -> Any:
        """A copy of ``schedule`` whose clock is this evaluator's."""
        clock: Callable[[], dt.datetime] = self._now
        drivable = hasattr(schedule, "nowfun") or callable(getattr(schedule, "now", None))
        if not drivable:
            raise InvalidSchedule(
                f"{self.label} has neither nowfun nor now(): celery_sched plans occurrences "
                "ahead of time and must ask the object about instants to come; subclass "
                "celery.schedules.BaseSchedule and read the time from self.now()"
            )
        cls = type(schedule)
        try:
            # Not copy.copy: a subclass of celery's schedule inherits a
            # __reduce__ that rebuilds it from schedule's own arguments.
            copied: Any = cls.__new__(cls)
            copied.__dict__.update(vars(schedule))
        except TypeError:  # no __dict__ (slots)
            raise InvalidSchedule(
                f"{self.label}: an object without __dict__ cannot be given a clock; "
                "subclass celery.schedules.BaseSchedule"
            ) from None
        if hasattr(schedule, "nowfun"):
            copied.nowfun = clock
        if callable(getattr(schedule, "now", None)):
            # A subclass's own now() may ignore nowfun; a property cannot be
            # replaced, and then nowfun must do.
            with contextlib.suppress(AttributeError):
                copied.now = clock
        return copied
