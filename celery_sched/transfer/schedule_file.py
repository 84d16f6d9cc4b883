"""The JSON-lines form of the ``schedules`` table: ``sched export`` writes it,
``sched import`` reads it back.

One JSON object per schedule::

    {"name": "nightly", "task": "proj.report",
     "schedule": {"kind": "crontab", "minute": "0", "hour": "3", "day_of_week": "*",
                  "day_of_month": "*", "month_of_year": "*"},
     "args": [], "kwargs": {}, "options": {"queue": "reports"}, "timezone": "Europe/Paris",
     "misfire": null, "overlap": "allow", "catchup_window": null, "max_catchup": null,
     "relative": false, "paused": false, "source": "dynamic", "enabled": true}

``schedule`` is the stored spec with its kind: ``crontab`` (the five cron
fields as text), ``interval`` (``seconds``), ``solar`` (``event``, ``lat``,
``lon``) or ``clocked`` (``at``, ISO 8601 UTC). A row with a ``schedule``
object is what tells ``sched import`` that a file holds schedules, not jobs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from celery.schedules import solar

from celery_sched.client import Client
from celery_sched.errors import CelerySchedError, InvalidSchedule
from celery_sched.models import ScheduleInfo
from celery_sched.schedules import CRON_FIELDS, clocked
from celery_sched.schedules.cron import read_crontab
from celery_sched.transfer import json_text
from celery_sched.transfer.schedule_entries import Read, ScheduleEntry, Skipped

#: Schedules read per query while exporting.
PAGE = 1000

#: The keys of an exported row besides ``name``, ``task`` and ``schedule``:
#: those ``add`` takes as they are.
_FIELDS = ("timezone", "misfire", "overlap", "catchup_window", "max_catchup", "relative")


def is_schedule_row(line: str) -> bool:
    """Whether a JSON line is an exported schedule (an object with a ``schedule`` object)."""
    try:
        value = json_text.loads(line)
    except ValueError:
        return False
    return isinstance(value, dict) and isinstance(value.get("schedule"), dict)


def export_rows(client: Client) -> Iterator[dict[str, Any]]:
    """Every stored schedule as an exported row, by name, a page at a time."""
    after: str | None = None
    while True:
        page = client.schedules.list(after=after, limit=PAGE)
        for info in page:
            yield export_row(info)
        if len(page) < PAGE:
            return
        after = page[-1].name


def export_row(info: ScheduleInfo) -> dict[str, Any]:
    """The exported row of one schedule; ValueError when its arguments
    cannot be read here (an export would lose them)."""
    if info.undecodable is not None:
        raise ValueError(f"schedule {info.name!r} cannot be exported: {info.undecodable}")
    return {
        "name": info.name,
        "task": info.task,
        "schedule": {"kind": info.kind, **info.spec},
        "args": list(info.args),
        "kwargs": dict(info.kwargs),
        "options": dict(info.options),
        "timezone": info.timezone,
        "misfire": info.misfire,
        "overlap": info.overlap,
        "catchup_window": info.catchup_window,
        "max_catchup": info.max_catchup,
        "relative": info.relative,
        "paused": info.paused,
        "source": info.source,
        "enabled": info.enabled,
    }


def dump_row(row: Mapping[str, Any]) -> str:
    """One exported row as a JSON line; ValueError names what JSON cannot hold."""
    try:
        return json.dumps(row, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"schedule {row.get('name')!r} cannot be exported as JSON ({exc}); its "
            "arguments or options hold values only its serializer can encode"
        ) from None


def read_entries(lines: Iterable[str], *, app: Any) -> Iterator[Read]:
    """The entries of an exported file, each one line (``line N``).

    Schedules defined in code (``source`` static) and those gone from it
    are skipped without being refused: the leader syncs them from the code.
    A line that is not a valid row is a refused :class:`Skipped`.
    """
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"line {number}"
        try:
            value = json_text.loads(line)
        except ValueError as exc:
            yield Skipped(where=where, name="?", reason=str(exc), refused=True)
            continue
        if not isinstance(value, dict):
            yield Skipped(
                where=where,
                name="?",
                reason=f"expected a JSON object, got {type(value).__name__}",
                refused=True,
            )
            continue
        yield _entry(where, value, app)


def _entry(where: str, row: dict[str, Any], app: Any) -> Read:
    name = row.get("name")
    label = json_text.one_line(name, 100) if isinstance(name, str) else "?"
    if row.get("source") == "static":
        reason = "defined in code (beat_schedule or a task decorator); the leader syncs it"
        if row.get("enabled") is False:
            reason = "defined in code once and gone from it (disabled)"
        return Skipped(where=where, name=label, reason=reason)
    try:
        fields: dict[str, Any] = {
            "name": name,
            "task": row.get("task"),
            "schedule": schedule_of(row.get("schedule"), app=app, what=f"schedule {label!r}"),
            "args": row.get("args") or (),
            "kwargs": row.get("kwargs") or {},
        }
        for key in _FIELDS:
            if row.get(key) is not None:
                fields[key] = row[key]
        options = row.get("options") or {}
        if not isinstance(options, dict):
            raise InvalidSchedule(f"options must be an object, got {type(options).__name__}")
        clash = sorted(set(options) & set(fields))
        if clash:
            raise InvalidSchedule(f"options may not be named {', '.join(clash)}")
        fields.update(options)
    except (CelerySchedError, ValueError, TypeError) as exc:
        reason = json_text.one_line(f"{type(exc).__name__}: {exc}")
        return Skipped(where=where, name=label, reason=reason, refused=True)
    return ScheduleEntry(where=where, fields=fields, paused=row.get("paused") is True)


def schedule_of(spec: Any, *, app: Any, what: str = "schedule") -> object:
    """The schedule object of an exported ``schedule`` spec (``what`` names
    it in errors)."""
    if not isinstance(spec, dict):
        raise InvalidSchedule(f"schedule must be an object, got {type(spec).__name__}")
    kind = spec.get("kind")
    if kind == "crontab":
        missing = [field for field in CRON_FIELDS if field not in spec]
        if missing:
            raise InvalidSchedule(f"crontab schedule lacks {', '.join(missing)}")
        return read_crontab(what, spec).as_crontab(app=app)
    if kind == "interval":
        seconds = spec.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool):
            raise InvalidSchedule(f"interval schedule needs seconds, got {seconds!r}")
        # Seconds, not a timedelta: add() bounds them (1e300 overflows a timedelta).
        return float(seconds)
    if kind == "solar":
        try:
            return solar(spec["event"], float(spec["lat"]), float(spec["lon"]), app=app)
        except KeyError as exc:
            raise InvalidSchedule(f"solar schedule lacks {exc.args[0]}") from None
    if kind == "clocked":
        return clocked(str(spec.get("at")), app=app)
    if kind == "custom":
        raise InvalidSchedule(
            "a custom schedule class works only in the code's schedules; define it there"
        )
    raise InvalidSchedule(f"unknown schedule kind {kind!r}")
