"""django-celery-beat's tables, read with SQL for ``sched import --from django-celery-beat``.

One query joins ``django_celery_beat_periodictask`` with its schedule tables
(crontab, interval, solar, clocked), so Django need not be installed or
configured: only the database is. The columns read are those of
django-celery-beat 2.2 and later.

How a periodic task comes over: its crontab keeps its own timezone; an
interval becomes seconds; ``queue``, ``exchange``, ``routing_key``,
``priority`` and ``headers`` become options, and ``expire_seconds`` the
``expires`` option (seconds after each occurrence). Left out on purpose:
disabled tasks. Refused, with the reason: a task with no or several
schedules, an absolute ``expires`` or a ``start_time`` still ahead (a
schedule here has neither), ``one_off`` on anything but a clocked schedule,
and arguments that are not JSON.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

import psycopg
from celery.schedules import solar
from psycopg import sql
from psycopg.rows import dict_row

from celery_sched.errors import InvalidImport, InvalidSchedule
from celery_sched.schedules import clocked
from celery_sched.schedules.cron import read_crontab
from celery_sched.settings import sanitize_url
from celery_sched.transfer import json_text
from celery_sched.transfer.schedule_entries import Read, ScheduleEntry, Skipped, read_each

#: Seconds per django-celery-beat interval period.
PERIOD_SECONDS = {
    "days": 86400.0,
    "hours": 3600.0,
    "minutes": 60.0,
    "seconds": 1.0,
    "microseconds": 1e-6,
}

_QUERY = """
SELECT t.name, t.task, t.args, t.kwargs, t.queue, t.exchange, t.routing_key, t.headers,
       t.priority, t.expires, t.expire_seconds, t.one_off, t.start_time, t.enabled,
       t.crontab_id, c.minute, c.hour, c.day_of_week, c.day_of_month, c.month_of_year,
       c.timezone,
       t.interval_id, i.every, i.period,
       t.solar_id, s.event, s.latitude, s.longitude,
       t.clocked_id, k.clocked_time,
       now() AS db_now
FROM {schema}.django_celery_beat_periodictask t
LEFT JOIN {schema}.django_celery_beat_crontabschedule c ON c.id = t.crontab_id
LEFT JOIN {schema}.django_celery_beat_intervalschedule i ON i.id = t.interval_id
LEFT JOIN {schema}.django_celery_beat_solarschedule s ON s.id = t.solar_id
LEFT JOIN {schema}.django_celery_beat_clockedschedule k ON k.id = t.clocked_id
ORDER BY t.name
"""


def read_entries(database_url: str, *, schema: str = "public", app: Any) -> list[Read]:
    """Every periodic task in django-celery-beat's tables, by name.

    ``database_url`` is a PostgreSQL URL (``postgresql://`` or SQLAlchemy's
    ``postgresql+psycopg://``); ``schema`` holds the tables. Raises
    :class:`~celery_sched.errors.InvalidImport` when they cannot be read
    (the URL's password masked).
    """
    conninfo = _conninfo(database_url)
    query = sql.SQL(_QUERY).format(schema=sql.Identifier(schema))
    try:
        with (
            psycopg.connect(conninfo, connect_timeout=10) as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            cur.execute(query)
            rows = cur.fetchall()
    except psycopg.Error as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InvalidImport(
            f"cannot read django-celery-beat's tables (schema {schema!r}) at "
            f"{sanitize_url(database_url)}: {first}"
        ) from None
    return entries_of(rows, app=app)


def entries_of(rows: Iterable[Mapping[str, Any]], *, app: Any) -> list[Read]:
    """The entry of each periodic-task row of :data:`_QUERY`; a row that
    cannot be read is refused with the reason, and the others go on."""
    return read_each(
        rows,
        lambda row: entry_of(row, app=app),
        lambda row: (f"periodic task {str(row['name'])[:100]!r}", str(row["name"])[:100]),
    )


def _conninfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.split("+", 1)[0] not in ("postgresql", "postgres"):
        raise InvalidImport(
            f"--database-url must be a PostgreSQL URL (postgresql://...), got {sanitize_url(url)!r}"
        )
    return "postgresql://" + rest


def entry_of(row: Mapping[str, Any], *, app: Any) -> Read:
    """The entry of one periodic-task row of :data:`_QUERY`."""
    name = str(row["name"])
    where = f"periodic task {name!r}"

    def refuse(reason: str) -> Skipped:
        return Skipped(where=where, name=name, reason=reason, refused=True)

    if not row["enabled"]:
        return Skipped(where=where, name=name, reason="disabled")
    now: dt.datetime = row["db_now"]
    if row["expires"] is not None:
        if row["expires"] <= now:
            return Skipped(where=where, name=name, reason=f"expired at {row['expires']}")
        return refuse(
            f"expires at {row['expires']}: a celery_sched schedule has no end date "
            "(its expires option is seconds after each occurrence)"
        )
    if row["start_time"] is not None and row["start_time"] > now:
        return refuse(f"starts at {row['start_time']}: a celery_sched schedule has no start time")
    kinds = [
        kind
        for kind in ("crontab", "interval", "solar", "clocked")
        if row[f"{kind}_id"] is not None
    ]
    if len(kinds) != 1:
        return refuse(
            f"has {'no schedule' if not kinds else 'several schedules: ' + ', '.join(kinds)}"
        )
    kind = kinds[0]
    if row["one_off"] and kind != "clocked":
        return refuse(f"one_off on a {kind} schedule (here only a clocked schedule runs once)")
    fields: dict[str, Any] = {"name": name, "task": row["task"]}
    try:
        fields["schedule"], timezone = _schedule(kind, row, app, f"schedule {name!r}")
        fields["args"] = _json(row["args"], "args", list) or ()
        fields["kwargs"] = _json(row["kwargs"], "kwargs", dict) or {}
        headers = _json(row["headers"], "headers", dict)
    except ValueError as exc:
        return refuse(json_text.one_line(f"{type(exc).__name__}: {exc}"))
    if timezone is not None:
        fields["timezone"] = timezone
    for option in ("queue", "exchange", "routing_key"):
        if row[option]:
            fields[option] = row[option]
    if row["priority"] is not None:
        fields["priority"] = row["priority"]
    if headers:
        fields["headers"] = headers
    if row["expire_seconds"]:
        fields["expires"] = row["expire_seconds"]
    return ScheduleEntry(where=where, fields=fields)


def _schedule(kind: str, row: Mapping[str, Any], app: Any, what: str) -> tuple[object, str | None]:
    """The schedule object of a row and its timezone (crontabs only)."""
    if kind == "crontab":
        fields = {
            field: row[field]
            for field in ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
        }
        zone = str(row["timezone"]) if row["timezone"] else None
        return read_crontab(what, fields).as_crontab(app=app), zone
    if kind == "interval":
        period = PERIOD_SECONDS.get(str(row["period"]))
        if period is None:
            raise InvalidSchedule(f"unknown interval period {row['period']!r}")
        # Seconds, not a timedelta: add() bounds them (a huge every overflows one).
        return float(row["every"]) * period, None
    if kind == "solar":
        return solar(row["event"], float(row["latitude"]), float(row["longitude"]), app=app), None
    return clocked(row["clocked_time"], app=app), None


def _json(text: Any, what: str, kind: type) -> Any:
    if text is None or not str(text).strip():
        return None
    try:
        value = json_text.loads(text)
    except ValueError as exc:
        raise InvalidSchedule(f"{what}: {exc}") from None
    if value is not None and not isinstance(value, kind):
        raise InvalidSchedule(f"{what} must be a JSON {kind.__name__}, got {type(value).__name__}")
    return value
