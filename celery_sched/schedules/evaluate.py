"""Evaluating specs: a spec's compiled definition (cached), and its first
and next nominal instants."""

from __future__ import annotations

import datetime as dt
import functools
import math
from typing import Any

from celery_sched.errors import InvalidSchedule
from celery_sched.models import ScheduleSpec
from celery_sched.schedules.clocked_time import CompiledClocked, parse_utc
from celery_sched.schedules.compiled import Compiled
from celery_sched.schedules.cron import CRON_FIELDS, CompiledCron
from celery_sched.schedules.custom import CustomDefinition
from celery_sched.schedules.interval import INTERVALS, CompiledInterval
from celery_sched.schedules.solar import CompiledSolar
from celery_sched.timeutil import UTC, ensure_utc, get_zone


def first_after(spec: ScheduleSpec, now: dt.datetime) -> dt.datetime | None:
    """The first nominal instant strictly after ``now`` of a schedule with no
    history, or None if it never fires after ``now``.

    Intervals: ``now + every``; with ``relative`` the first occurrence is
    aligned as beat aligns it: the last boundary of the interval's
    resolution (day, hour, minute, second on the schedule's wall clock) at
    or before ``now + every``. Other kinds: :func:`next_after` ``(now)``.
    """
    compiled = compile_spec(spec)
    return compiled.next_after(compiled.anchor(utc_argument(now, "now")))


def next_after(spec: ScheduleSpec, after: dt.datetime) -> dt.datetime | None:
    """The next nominal instant strictly after ``after`` (aware UTC), or None
    if the schedule never fires again.

    Intervals: ``after + every`` (``after`` is the previous nominal instant,
    so nothing drifts). Crontab: the first matching wall-clock minute in the
    schedule's timezone whose instant is after ``after``, with the DST rules
    of :mod:`~celery_sched.schedules.wallclock`. Solar: the next event.
    Clocked: ``at`` if it is after ``after``. Custom: the first instant after
    ``after`` at which the object, asked as beat asks it with ``last_run_at =
    after``, is due (:class:`~celery_sched.schedules.custom.CompiledCustom`).
    Raises InvalidSchedule if the definition does not evaluate.
    """
    if spec.kind == "interval":
        # The planner's hot path: one dict lookup and one addition.
        seconds = spec.spec.get("seconds")
        every = INTERVALS.get(seconds) if type(seconds) is float or type(seconds) is int else None
        if every is not None:
            if after.tzinfo is not UTC:
                after = utc_argument(after, "after")
            try:
                return after + every
            except OverflowError:
                return None
    return compile_spec(spec).next_after(utc_argument(after, "after"))


def utc_argument(value: dt.datetime, name: str) -> dt.datetime:
    """``value``, an instant given as argument ``name``, as aware UTC;
    TypeError unless a datetime, ValueError if naive."""
    if type(value) is not dt.datetime and not isinstance(value, dt.datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    return value if value.tzinfo is UTC else ensure_utc(value, name=name)


def compile_spec(spec: ScheduleSpec) -> Compiled:
    """The evaluator of ``spec`` (cached by definition); InvalidSchedule if
    the definition does not evaluate.

    A custom schedule evaluates only from the spec the code built (its
    definition carries the object); one read back from the store does not.
    """
    definition = spec.spec
    if spec.kind == "custom":
        return _compile_custom(spec)
    try:
        if spec.kind == "interval":
            key: tuple[Any, ...] = (definition["seconds"],)
            if type(key[0]) is bool:  # the cache would take True for 1
                raise InvalidSchedule(f"interval seconds must be a number, got {key[0]!r}")
        elif spec.kind == "crontab":
            key = (
                definition["minute"],
                definition["hour"],
                definition["day_of_week"],
                definition["day_of_month"],
                definition["month_of_year"],
            )
        elif spec.kind == "solar":
            key = (definition["event"], definition["lat"], definition["lon"])
        else:
            key = (definition["at"],)
        return _compile(spec.kind, key, spec.timezone, spec.relative)
    except KeyError as exc:
        raise InvalidSchedule(
            f"schedule {spec.name!r}: {spec.kind} spec lacks {exc.args[0]!r}: {dict(definition)}"
        ) from None
    except InvalidSchedule as exc:
        raise InvalidSchedule(f"schedule {spec.name!r}: {exc}") from exc
    except TypeError as exc:  # an unhashable value in the definition
        raise InvalidSchedule(f"schedule {spec.name!r}: invalid {spec.kind} spec: {exc}") from exc


def _compile_custom(spec: ScheduleSpec) -> Compiled:
    definition = spec.spec
    if not isinstance(definition, CustomDefinition):
        shown = definition.get("repr") or definition.get("class") or dict(definition)
        raise InvalidSchedule(
            f"schedule {spec.name!r}: custom schedule {shown} is evaluated from the object "
            "in the code (a beat_schedule entry or a decorated task), and this process has "
            "no such object of that name"
        )
    return definition.compiled(spec.name, get_zone(spec.timezone), spec.timezone)


@functools.lru_cache(maxsize=16384)
def _compile(kind: str, key: tuple[Any, ...], zone_name: str, relative: bool) -> Compiled:
    zone = get_zone(zone_name)
    if kind == "interval":
        seconds = key[0]
        if type(seconds) is bool or not isinstance(seconds, (int, float)):
            raise InvalidSchedule(f"interval seconds must be a number, got {seconds!r}")
        if not math.isfinite(seconds) or seconds <= 0:
            raise InvalidSchedule(f"interval must be positive, got {seconds!r} seconds")
        return CompiledInterval(float(seconds), relative, zone)
    if kind == "crontab":
        return CompiledCron(dict(zip(CRON_FIELDS, key, strict=True)), zone)
    if kind == "solar":
        event, lat, lon = key
        if not isinstance(event, str):
            raise InvalidSchedule(f"solar event must be a string, got {event!r}")
        for label, value in (("lat", lat), ("lon", lon)):
            if type(value) is bool or not isinstance(value, (int, float)):
                raise InvalidSchedule(f"solar {label} must be a number, got {value!r}")
        return CompiledSolar(event, float(lat), float(lon))
    if kind == "clocked":
        try:
            return CompiledClocked(parse_utc(str(key[0])))
        except ValueError as exc:
            raise InvalidSchedule(f"clocked time {key[0]!r} is invalid: {exc}") from exc
    raise InvalidSchedule(f"unknown schedule kind {kind!r}")
