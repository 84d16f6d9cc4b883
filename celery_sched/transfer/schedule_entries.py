"""What the schedule readers share: entries, skipped entries, and the import.

A reader (export file, redbeat, django-celery-beat) turns each stored
schedule it finds into a :class:`ScheduleEntry` (the keywords of
``Client.schedules.add``) or a :class:`Skipped` saying why it cannot come
over (disabled, an unsupported schedule type, ...). :func:`import_entries`
then checks every entry on its own, skips those that fail or whose name is
taken, and adds the rest in one all-or-nothing ``add_many``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from celery_sched.client import Client
from celery_sched.errors import CelerySchedError
from celery_sched.transfer import json_text

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleEntry:
    """One schedule to add: ``fields`` are :meth:`ScheduleManager.add_many`'s
    entry keys (``name``, ``task``, ``schedule``, ``args``, ..., options
    flat); ``where`` says where it was read (``line 3``, a Redis key)."""

    where: str
    fields: Mapping[str, Any]
    paused: bool = False

    @property
    def name(self) -> str:
        return str(self.fields["name"])


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Skipped:
    """A stored schedule left out of the import, and why.

    ``refused``: the input is wrong or cannot be carried over (malformed,
    invalid, an unsupported schedule type), which fails the import's exit
    status; otherwise it was left out on purpose (disabled, defined in
    code, its name already stored)."""

    where: str
    name: str
    reason: str
    refused: bool = False


Read = ScheduleEntry | Skipped

#: What checking or reading one entry may raise besides the project's own
#: errors: Celery's schedule classes, ephem and the datetime constructors
#: refuse values with ValueError, TypeError or OverflowError. One entry's
#: refusal must never end the import of the others.
UNREADABLE = (CelerySchedError, ValueError, TypeError, ArithmeticError, RecursionError)


def read_each(
    items: Iterable[T], read: Callable[[T], Read], where: Callable[[T], tuple[str, str]]
) -> list[Read]:
    """``read`` of each item; an item it cannot read is a refused :class:`Skipped`
    at ``where(item)`` (its place and name), with the reason."""
    entries: list[Read] = []
    for item in items:
        try:
            entries.append(read(item))
        except UNREADABLE as exc:
            place, name = where(item)
            reason = json_text.one_line(f"{type(exc).__name__}: {exc}")
            entries.append(Skipped(where=place, name=name, reason=reason, refused=True))
    return entries


@dataclasses.dataclass(kw_only=True, slots=True)
class ScheduleImport:
    """What an import of schedules did (or, with ``dry_run``, would do)."""

    added: list[ScheduleEntry] = dataclasses.field(default_factory=list)
    skipped: list[Skipped] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No entry was refused (entries left out on purpose do not count)."""
        return not any(skip.refused for skip in self.skipped)


def import_entries(
    client: Client, entries: Iterable[Read], *, dry_run: bool = False, check_task: bool = True
) -> ScheduleImport:
    """Check each entry, skip the bad ones (reason given), add the others at once.

    An entry is skipped when its reader skipped it, when a schedule of that
    name is stored already or came earlier in the input, or when
    ``Client.schedules.check`` refuses it (invalid crontab, unknown
    timezone, unknown task with ``check_task``, ...). The good entries are
    added in one ``add_many`` (all or nothing); those marked ``paused`` are
    then paused. ``dry_run`` writes nothing.
    """
    result = ScheduleImport()
    taken = {row.name for row in client.store.list_schedules()}
    first_seen: dict[str, str] = {}
    for entry in entries:
        if isinstance(entry, Skipped):
            result.skipped.append(entry)
            continue
        name = entry.name
        refusal = _refusal(client, entry, taken, first_seen, check_task=check_task)
        if refusal is not None:
            result.skipped.append(refusal)
            continue
        first_seen[name] = entry.where
        result.added.append(entry)
    if dry_run or not result.added:
        return result
    client.schedules.add_many([entry.fields for entry in result.added], check_task=check_task)
    for entry in result.added:
        if entry.paused:
            client.schedules.pause(entry.name)
    return result


def _refusal(
    client: Client,
    entry: ScheduleEntry,
    taken: set[str],
    first_seen: dict[str, str],
    *,
    check_task: bool,
) -> Skipped | None:
    """Why ``entry`` is not added (stored already, named twice, invalid), or None."""
    label = json_text.one_line(entry.name, 100)
    if entry.name in taken:
        return Skipped(where=entry.where, name=label, reason="a schedule of that name is stored")
    if entry.name in first_seen:
        reason = f"the name is taken by the entry at {first_seen[entry.name]}"
    else:
        try:
            client.schedules.check(entry.fields, check_task=check_task)
        except UNREADABLE as exc:
            reason = json_text.one_line(f"{type(exc).__name__}: {exc}")
        else:
            return None
    return Skipped(where=entry.where, name=label, reason=reason, refused=True)
