"""celery-redbeat's entries, read from Redis for ``sched import --from redbeat``.

redbeat keeps each entry in a hash ``<prefix><name>`` whose ``definition``
field is JSON (``name``, ``task``, ``schedule``, ``args``, ``kwargs``,
``options``, ``enabled``), with schedules and datetimes tagged by
``__type__``; the sorted set ``<prefix>:schedule`` lists the keys of every
entry, and the set ``<prefix>:statics`` the names that came from the app's
``beat_schedule``. This module reads that format itself, so redbeat need
not be installed to leave it.

Entries that are disabled, or come from ``beat_schedule`` (celery_sched
reads that from the code), are skipped on purpose; ``rrule`` schedules, and
anything else celery_sched has no equivalent for, are refused.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import redis
from celery.schedules import ParseException, crontab

from celery_sched.errors import InvalidImport
from celery_sched.redisconn import build_client
from celery_sched.settings import sanitize_url
from celery_sched.transfer import json_text
from celery_sched.transfer.schedule_entries import Read, ScheduleEntry, Skipped, read_each

#: redbeat's default ``redbeat_key_prefix``.
DEFAULT_PREFIX = "redbeat:"


def read_entries(redis_url: str, *, key_prefix: str = DEFAULT_PREFIX, app: Any) -> list[Read]:
    """Every entry redbeat stores under ``key_prefix``, in its schedule's order.

    Raises :class:`~celery_sched.errors.InvalidImport` when Redis cannot be
    read (the URL's password masked).
    """
    try:
        client = build_client(redis_url, name="--redis-url", decode_responses=True)
    except ValueError as exc:  # redis-py's, or InvalidURL for a Sentinel URL
        raise InvalidImport(f"invalid --redis-url {sanitize_url(redis_url)}: {exc}") from None
    try:
        with client:
            keys = [str(key) for key in client.zrange(key_prefix + ":schedule", 0, -1)]
            statics = {str(name) for name in client.smembers(key_prefix + ":statics")}
            with client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.hget(key, "definition")
                definitions: list[str | None] = pipe.execute()
    except redis.RedisError as exc:
        raise InvalidImport(
            f"cannot read redbeat's entries from Redis at {sanitize_url(redis_url)}: {exc}"
        ) from None
    return read_each(
        zip(keys, definitions, strict=True),
        lambda pair: entry_of(pair[0], pair[0].removeprefix(key_prefix), pair[1], statics, app),
        lambda pair: (_where(pair[0]), json_text.one_line(pair[0].removeprefix(key_prefix), 100)),
    )


def _where(key: str) -> str:
    return f"Redis key {json_text.one_line(key, 200)}"


def entry_of(key: str, name: str, text: str | None, statics: set[str], app: Any) -> Read:
    """The entry of the redbeat hash ``key`` (entry ``name``) whose
    ``definition`` field is ``text``."""
    where = _where(key)
    label = json_text.one_line(name, 100)  # what a skipped entry is shown as
    if text is None:
        return Skipped(where=where, name=label, reason="listed but has no definition (deleted)")
    try:
        definition = json_text.loads(text, object_hook=_decode)
    except (ValueError, TypeError, KeyError, ArithmeticError) as exc:
        reason = json_text.one_line(f"unreadable definition: {exc}")
        return Skipped(where=where, name=label, reason=reason, refused=True)
    if not isinstance(definition, dict):
        reason = f"unreadable definition: a JSON {type(definition).__name__}, not an object"
        return Skipped(where=where, name=label, reason=reason, refused=True)
    if definition.get("name") is not None and not isinstance(definition["name"], str):
        reason = f"name must be a string, got {type(definition['name']).__name__}"
        return Skipped(where=where, name=label, reason=reason, refused=True)
    name = definition.get("name") or name
    label = json_text.one_line(name, 100)
    if name in statics:
        return Skipped(
            where=where,
            name=label,
            reason="from the app's beat_schedule; celery_sched reads it from the code",
        )
    if definition.get("enabled") is False:
        return Skipped(where=where, name=label, reason="disabled")
    try:
        schedule, relative = _schedule(definition.get("schedule"), app)
    except ValueError as exc:
        return Skipped(where=where, name=label, reason=json_text.one_line(str(exc)), refused=True)
    fields: dict[str, Any] = {
        "name": name,
        "task": definition.get("task"),
        "schedule": schedule,
        "args": definition.get("args") or (),
        "kwargs": definition.get("kwargs") or {},
        "relative": relative,
    }
    options = definition.get("options") or {}
    if not isinstance(options, dict):
        return Skipped(where=where, name=label, reason="options is not a mapping", refused=True)
    clash = sorted(set(options) & set(fields))
    if clash:
        reason = f"options may not be named {', '.join(clash)}"
        return Skipped(where=where, name=label, reason=reason, refused=True)
    fields.update(options)
    return ScheduleEntry(where=where, fields=fields)


def _schedule(value: Any, app: Any) -> tuple[object, bool]:
    """The schedule object of a decoded definition and its ``relative``."""
    if not isinstance(value, dict):
        raise ValueError(f"unsupported schedule {value!r}")
    kind = value.get("__type__")
    if kind == "crontab":
        fields = {key: item for key, item in value.items() if key != "__type__"}
        try:
            return crontab(app=app, **fields), False
        except (ValueError, TypeError, ParseException) as exc:
            raise ValueError(f"invalid crontab {fields}: {exc}") from None
    if kind == "interval":
        every = value.get("every")
        if not isinstance(every, (int, float)) or isinstance(every, bool):
            raise ValueError(f"interval schedule without seconds: {value!r}")
        # Seconds, not a timedelta: add() bounds them (1e300 overflows a timedelta).
        return float(every), value.get("relative") is True
    raise ValueError(
        f"unsupported schedule type {kind!r} (celery_sched has crontab, interval, solar "
        "and clocked schedules)"
    )


def _decode(obj: dict[str, Any]) -> Any:
    """The JSON object hook: redbeat's tagged datetimes become datetimes;
    schedules stay tagged dicts for :func:`_schedule`."""
    if obj.get("__type__") != "datetime":
        return obj
    zone = obj.get("timezone", "UTC")
    tz: dt.tzinfo
    if isinstance(zone, (int, float)):
        tz = dt.timezone(dt.timedelta(seconds=zone))
    else:
        from celery_sched.timeutil import get_zone

        tz = get_zone(str(zone))
    fields = {k: obj[k] for k in ("year", "month", "day", "hour", "minute", "second")}
    return dt.datetime(**fields, microsecond=obj.get("microsecond", 0), tzinfo=tz)
