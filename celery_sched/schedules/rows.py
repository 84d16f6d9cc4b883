"""Schedules as rows: a spec written as a stored schedule, a stored schedule
read back as a spec, and the job of one occurrence with its key.

The planner and the client's schedule operations both read and write
schedules through these; what *when* means lives in the rest of
:mod:`celery_sched.schedules`.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable
from typing import Any

from celery_sched.errors import InvalidJob, InvalidSchedule, UnknownTimezone
from celery_sched.models import (
    EMPTY_OPTIONS,
    MESSAGE_OPTIONS,
    MisfirePolicy,
    NewJob,
    NewSchedule,
    OverlapPolicy,
    ScheduleSpec,
    StoredSchedule,
    accepted_content_types,
)
from celery_sched.protocol import MAX_KEY_LENGTH
from celery_sched.schedules.evaluate import first_after, next_after
from celery_sched.timeutil import UTC, ensure_utc
from celery_sched.validation import JobBuilder

__all__ = [
    "MAX_NAME_LENGTH",
    "broken_reason",
    "cursor_before",
    "first_nominal",
    "occurrence_job",
    "occurrence_key",
    "schedule_row",
    "spec_of",
]

# "<name>@2026-03-08T07:00:00.123456Z" is at most 28 characters past the name.
_KEY_SUFFIX = 28
#: The longest schedule name: every occurrence key must fit a job key.
MAX_NAME_LENGTH = MAX_KEY_LENGTH - _KEY_SUFFIX

#: How far before an instant a cursor is placed so that the schedule's next
#: instant after the cursor is exactly that one (all kinds but intervals).
#: Crontab instants are whole minutes and solar ones whole seconds, rounded
#: to the nearest: less than a second before could lie after the raw event.
_JUST_BEFORE = dt.timedelta(seconds=1)
_MIN_INSTANT = dt.datetime.min.replace(tzinfo=dt.UTC)
#: A broken schedule's reason is shown in a table row; a whole traceback's
#: worth of message belongs in the log.
_REASON_LIMIT = 500


def occurrence_key(name: str, nominal: dt.datetime) -> str:
    """The job key of one occurrence: ``"<name>@<nominal UTC, ISO 8601>Z"``.

    Two planners computing the same occurrence build the same key, which the
    store's unique index turns into one row. Microseconds appear only when
    non-zero: ``occurrence_key("report", t) == "report@2026-03-08T07:00:00Z"``.
    """
    if nominal.tzinfo is not UTC:
        nominal = ensure_utc(nominal, name="nominal")
    return f"{name}@{nominal.replace(tzinfo=None).isoformat()}Z"


def schedule_row(
    spec: ScheduleSpec, builder: JobBuilder, *, now: dt.datetime, check_task: bool = False
) -> NewSchedule:
    """The row of ``spec``: its task body serialized once, its first instant
    computed at ``now`` (:func:`first_nominal`).

    Raises :class:`~celery_sched.errors.InvalidSchedule` naming the problem
    (arguments the serializer refuses, a serializer the app's
    ``accept_content`` does not list, a payload over the limit, an invalid
    option, or with ``check_task`` an unregistered task).
    """
    _check_accepted(spec.name, builder)
    try:
        sample = builder.build(
            spec.task,
            spec.args,
            dict(spec.kwargs),
            eta=now,
            key=occurrence_key(spec.name, now),
            check_task=check_task,
            now=lambda: now,
            options=spec.options,
        )
    except UnknownTimezone:
        raise
    except InvalidJob as exc:
        raise InvalidSchedule(f"schedule {spec.name!r}: {exc}") from exc
    return NewSchedule(
        name=spec.name,
        task=spec.task,
        kind=spec.kind,
        spec=dict(spec.spec),
        body=sample.body,
        content_type=sample.content_type,
        content_encoding=sample.content_encoding,
        argsrepr=sample.argsrepr,
        kwargsrepr=sample.kwargsrepr,
        options=dict(spec.options),
        timezone=spec.timezone,
        misfire=None if spec.misfire is None else spec.misfire.value,
        overlap=spec.overlap.value,
        catchup_window=spec.catchup_window,
        max_catchup=spec.max_catchup,
        relative=spec.relative,
        enabled=spec.enabled,
        source=spec.source,
        next_nominal_at=first_nominal(spec, now),
    )


def first_nominal(spec: ScheduleSpec, now: dt.datetime) -> dt.datetime | None:
    """The first instant of a schedule added (or restarted) at ``now``.

    The first instant after ``now``, except for a clocked one-off, whose
    instant is its time even when that has passed: the misfire policy then
    decides whether it still runs (``once``, the default, runs it).
    """
    if spec.kind == "clocked":
        return next_after(spec, _MIN_INSTANT)
    return first_after(spec, now)


def _check_accepted(name: str, builder: JobBuilder) -> None:
    """InvalidSchedule when the app's workers would refuse the task serializer:
    every occurrence would be refused, and the stored arguments could not
    be read back (``Client.schedules.list``)."""
    conf = builder.app.conf
    if builder.content_type in accepted_content_types(conf.accept_content):
        return
    raise InvalidSchedule(
        f"schedule {name!r}: the task serializer {conf.task_serializer!r} "
        f"({builder.content_type}) is not in the app's accept_content "
        f"({', '.join(map(str, conf.accept_content or ()))}): its workers would refuse "
        "every occurrence; add it to accept_content or choose another task_serializer"
    )


def cursor_before(spec: ScheduleSpec, instant: dt.datetime) -> dt.datetime:
    """A cursor whose next instant is ``instant`` (an instant of ``spec``).

    Intervals step from the cursor, so it must be exactly one interval
    earlier; every other kind is absolute in time, and any moment between
    the previous instant and ``instant`` will do.
    """
    if spec.kind == "interval":
        return instant - dt.timedelta(seconds=float(spec.spec["seconds"]))
    return instant - _JUST_BEFORE


def spec_of(row: StoredSchedule) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of a stored row (what :func:`~celery_sched.schedules.plan` reads).

    Raises InvalidSchedule / UnknownTimezone if the stored definition no
    longer validates (a timezone removed from tzdata, say).
    """
    return ScheduleSpec(
        name=row.name,
        task=row.task,
        kind=row.kind,
        spec=row.spec,
        timezone=row.timezone,
        misfire=None if row.misfire is None else MisfirePolicy(row.misfire),
        overlap=OverlapPolicy(row.overlap),
        catchup_window=row.catchup_window,
        max_catchup=row.max_catchup,
        relative=row.relative,
        enabled=row.enabled,
        source=row.source,
    )


def broken_reason(exc: BaseException) -> str:
    """The ``broken_reason`` of a schedule whose planning raised ``exc``: one
    line of text PostgreSQL stores (no NUL, no lone surrogate), bounded."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    text = text.replace("\x00", "\\x00").encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > _REASON_LIMIT:
        text = text[: _REASON_LIMIT - 3] + "..."
    return text


def occurrence_job(
    row: StoredSchedule,
    nominal: dt.datetime,
    *,
    now: dt.datetime,
    job_id: Any,
    max_attempts: int,
    shard_of: Callable[[str], int],
) -> NewJob:
    """The job of one occurrence of ``row`` at ``nominal``: the schedule's
    stored body and options, due at the nominal instant.

    ``expires`` counts from the send, as beat counts it: the job keeps the
    seconds in its options (as ``expires``) and no ``expires_at``, and the
    dispatcher fixes the instant when it publishes
    (:func:`celery_sched.protocol.send_expires_at`). An occurrence that waits
    in the store (a leader down, a backlog) is therefore still sent.
    """
    options = row.options
    message = {
        name: value
        for name, value in options.items()
        if name in MESSAGE_OPTIONS and value is not None
    }
    # Checked here all the same: a value no send could count from marks the
    # schedule broken now, not each of its jobs rejected later.
    if _expires_at(row, max(nominal, now)) is not None:
        message["expires"] = float(row.options["expires"])
    key = occurrence_key(row.name, nominal)
    return NewJob(
        id=job_id,
        key=key,
        task=row.task,
        body=row.body,
        content_type=row.content_type,
        content_encoding=row.content_encoding,
        argsrepr=row.argsrepr,
        kwargsrepr=row.kwargsrepr,
        options=message or EMPTY_OPTIONS,
        due_at=nominal,
        max_attempts=int(options.get("max_attempts") or max_attempts),
        shard=shard_of(key),
        schedule_id=row.id,
        visibility_timeout=_seconds(options.get("visibility_timeout")),
        max_runtime=_seconds(options.get("max_runtime")),
    )


def _expires_at(row: StoredSchedule, start: dt.datetime) -> dt.datetime | None:
    """``start`` plus the schedule's ``expires`` option, or None without one.

    Raises InvalidSchedule naming the schedule when that is not a number of
    seconds or lands past the latest date a datetime holds (what validation
    refuses now, but an older row may hold).
    """
    expires = row.options.get("expires")
    if expires is None:
        return None
    try:
        seconds = float(expires)
        if not math.isfinite(seconds):
            raise ValueError(seconds)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidSchedule(
            f"schedule {row.name!r}: expires must be a finite number of seconds, got {expires!r}"
        ) from exc
    try:
        return start + dt.timedelta(seconds=seconds)
    except OverflowError as exc:
        raise InvalidSchedule(
            f"schedule {row.name!r}: expires {seconds:g} s after "
            f"{start:%Y-%m-%dT%H:%M:%SZ} is past the latest date (year 9999)"
        ) from exc


def _seconds(value: Any) -> float | None:
    return None if value is None else float(value)
