"""The periodic schedules in memory: :class:`~celery_sched.interfaces.ScheduleStore`
for unit tests."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Sequence
from typing import Any

from celery_sched.errors import InvalidSchedule, ScheduleExists, UnknownSchedule
from celery_sched.interfaces import ScheduleStore
from celery_sched.models import (
    UNFINISHED_STATUSES,
    Job,
    JobStatus,
    NewJob,
    NewSchedule,
    PlanCommit,
    ScheduleAdvance,
    ScheduleRuns,
    StoredSchedule,
    SyncResult,
)
from celery_sched.store.memory.base import MemoryStoreBase
from celery_sched.timeutil import ensure_utc


class MemoryScheduleStore(MemoryStoreBase, ScheduleStore):
    """:class:`~celery_sched.interfaces.ScheduleStore` in memory."""

    def add_schedules(self, schedules: Sequence[NewSchedule]) -> int:
        _refuse_duplicate_names(schedules)
        with self._lock:
            for schedule in schedules:
                if schedule.name in self._schedules:
                    raise ScheduleExists(name=schedule.name)
            now = self.now()
            for schedule in schedules:
                self._schedules[schedule.name] = self._new_schedule(schedule, now)
            return len(schedules)

    def get_schedule(self, name: str) -> StoredSchedule | None:
        with self._lock:
            return self._schedules.get(name)

    def schedules_by_id(self, schedule_ids: Sequence[int]) -> dict[int, StoredSchedule]:
        wanted = set(schedule_ids)
        with self._lock:
            return {s.id: s for s in self._schedules.values() if s.id in wanted}

    def list_schedules(
        self, *, after: str | None = None, limit: int | None = None
    ) -> list[StoredSchedule]:
        with self._lock:
            rows = sorted(
                (s for s in self._schedules.values() if after is None or s.name > after),
                key=lambda s: s.name,
            )
        return rows if limit is None else rows[: max(limit, 0)]

    def count_schedules(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        with self._lock:
            for schedule in self._schedules.values():
                state = (
                    "disabled"
                    if not schedule.enabled
                    else "paused"
                    if schedule.paused
                    else "broken"
                    if schedule.broken_at is not None
                    else "active"
                )
                counts[state] = counts.get(state, 0) + 1
        return counts

    def schedule_runs(self, schedule_ids: Sequence[int]) -> dict[int, ScheduleRuns]:
        wanted = set(schedule_ids)
        with self._lock:
            now = self.now()
            nexts: dict[int, dt.datetime] = {}
            lasts: dict[int, Job] = {}
            for job in self._jobs.values():
                sid = job.schedule_id
                if sid is None or sid not in wanted:
                    continue
                if job.due_at > now:
                    if job.status == JobStatus.PENDING and (
                        sid not in nexts or job.due_at < nexts[sid]
                    ):
                        nexts[sid] = job.due_at
                elif sid not in lasts or job.due_at > lasts[sid].due_at:
                    lasts[sid] = job
        return {
            sid: ScheduleRuns(
                next_due_at=nexts.get(sid),
                last_due_at=lasts[sid].due_at if sid in lasts else None,
                last_status=lasts[sid].status if sid in lasts else None,
            )
            for sid in wanted
            if sid in nexts or sid in lasts
        }

    def schedule_history(self, schedule_id: int, *, limit: int) -> list[Job]:
        with self._lock:
            now = self.now()
            jobs = [
                job
                for job in self._jobs.values()
                if job.schedule_id == schedule_id and job.due_at <= now
            ]
        jobs.sort(key=lambda job: (job.due_at, job.id), reverse=True)
        return jobs[: max(limit, 0)]

    def replace_schedule(
        self, schedule: NewSchedule, *, expected_version: int, restart: bool
    ) -> StoredSchedule | None:
        with self._lock:
            stored = self._schedules.get(schedule.name)
            if stored is None:
                raise UnknownSchedule(name=schedule.name)
            if stored.version != expected_version:
                return None
            changes = _definition(schedule)
            changes.update(_UNBROKEN)
            if restart:
                changes.update(last_nominal_at=None, next_nominal_at=schedule.next_nominal_at)
            self._change_schedule(stored, **changes)
            self._withdraw([stored.id], roll_back=set() if restart else {stored.id})
            return self._schedules[schedule.name]

    def set_schedule_paused(self, name: str, paused: bool) -> StoredSchedule:
        with self._lock:
            stored = self._schedules.get(name)
            if stored is None:
                raise UnknownSchedule(name=name)
            if stored.paused != paused:
                self._change_schedule(stored, paused=paused, **({} if paused else _UNBROKEN))
                if paused:
                    self._withdraw([stored.id], roll_back={stored.id})
            elif not paused and stored.broken_at is not None:
                self._change_schedule(stored, **_UNBROKEN)
            return self._schedules[name]

    def delete_schedule(self, name: str) -> bool:
        with self._lock:
            stored = self._schedules.get(name)
            if stored is None:
                return False
            self._withdraw([stored.id], roll_back=set())
            del self._schedules[name]
            return True

    def trigger_occurrence(self, job: NewJob, *, skip_if_busy: bool) -> Job | None:
        if job.schedule_id is None:
            raise ValueError("a triggered occurrence needs its schedule_id")
        with self._lock:
            if not any(s.id == job.schedule_id for s in self._schedules.values()):
                raise UnknownSchedule(f"schedule {job.schedule_id} no longer exists")
            if skip_if_busy:
                now = self.now()
                for other in self._jobs.values():
                    if (
                        other.schedule_id == job.schedule_id
                        and other.status in UNFINISHED_STATUSES
                        and (other.status != JobStatus.PENDING or other.due_at <= now)
                    ):
                        return None
            return self._insert(job, "return")

    def sync_static_schedules(self, schedules: Sequence[NewSchedule]) -> SyncResult:
        _refuse_duplicate_names(schedules)
        with self._lock:
            now = self.now()
            wanted = {s.name: dataclasses.replace(s, source="static") for s in schedules}
            added = 0
            restarted: list[int] = []
            rolled: list[int] = []
            conflicts: list[str] = []
            for name, new in wanted.items():
                stored = self._schedules.get(name)
                if stored is None:
                    self._schedules[name] = self._new_schedule(new, now)
                    added += 1
                elif stored.source != "static":
                    conflicts.append(name)
                elif stored.as_new().definition() != new.definition():
                    changes = _definition(new)
                    changes.update(
                        enabled=new.enabled,
                        disabled_at=None if new.enabled else (stored.disabled_at or now),
                        **_UNBROKEN,
                    )
                    restart = (not stored.enabled and new.enabled) or (
                        stored.as_new().timing() != new.timing()
                    )
                    if restart:
                        changes.update(last_nominal_at=None, next_nominal_at=new.next_nominal_at)
                        restarted.append(stored.id)
                    else:
                        rolled.append(stored.id)
                    self._change_schedule(stored, **changes)
            disabled: list[int] = []
            for stored in list(self._schedules.values()):
                if stored.source == "static" and stored.enabled and stored.name not in wanted:
                    self._change_schedule(stored, enabled=False, disabled_at=now)
                    disabled.append(stored.id)
            self._withdraw([*restarted, *rolled, *disabled], roll_back=set(rolled))
            updated = len(restarted) + len(rolled)
            return SyncResult(
                added=added,
                updated=updated,
                disabled=len(disabled),
                unchanged=len(wanted) - added - updated - len(conflicts),
                conflicts=tuple(conflicts),
            )

    def due_schedules(
        self,
        *,
        horizon: dt.datetime,
        shard: int,
        shards: int,
        limit: int,
        after: tuple[dt.datetime, int] | None = None,
    ) -> list[StoredSchedule]:
        horizon = ensure_utc(horizon, name="horizon")
        if after is not None:
            after = (ensure_utc(after[0], name="after"), after[1])
        with self._lock:
            rows = [
                s
                for s in self._schedules.values()
                if s.enabled
                and not s.paused
                and s.broken_at is None
                and s.next_nominal_at is not None
                and s.next_nominal_at <= horizon
                and s.id % max(shards, 1) == shard
                and (after is None or (s.next_nominal_at, s.id) > after)
            ]
        rows.sort(key=lambda s: (s.next_nominal_at, s.id))
        return rows[: max(limit, 0)]

    def busy_schedules(self, schedule_ids: Sequence[int]) -> set[int]:
        wanted = set(schedule_ids)
        with self._lock:
            return {
                job.schedule_id
                for job in self._jobs.values()
                if job.schedule_id is not None
                and job.schedule_id in wanted
                and job.status in UNFINISHED_STATUSES
            }

    def commit_plans(self, advances: Sequence[ScheduleAdvance]) -> PlanCommit:
        with self._lock:
            by_id = {s.id: s for s in self._schedules.values()}
            now = self.now()
            written: list[tuple[uuid.UUID, dt.datetime, int]] = []
            stale = busy = 0
            for advance in sorted(advances, key=lambda a: a.schedule_id):
                stored = by_id.get(advance.schedule_id)
                if (
                    stored is None
                    or stored.version != advance.version
                    or not stored.enabled
                    or stored.paused
                    or stored.broken_at is not None
                    or (
                        stored.last_nominal_at is not None
                        and advance.last_nominal_at is not None
                        and stored.last_nominal_at > advance.last_nominal_at
                    )
                ):
                    stale += 1
                    continue
                self._schedules[stored.name] = dataclasses.replace(
                    stored,
                    last_nominal_at=advance.last_nominal_at,
                    next_nominal_at=advance.next_nominal_at,
                )
                if advance.skip_if_busy and self.busy_schedules([stored.id]):
                    busy += len(advance.occurrences)
                    continue
                for job in advance.occurrences:
                    if job.key in self._by_key or job.id in self._jobs:
                        continue
                    self._put(self._new_row(job, now))
                    written.append((job.id, job.due_at, job.shard))
            return PlanCommit(written=written, stale=stale, busy=busy)

    def mark_schedule_broken(self, schedule_id: int, *, version: int, reason: str) -> bool:
        with self._lock:
            for stored in self._schedules.values():
                if stored.id == schedule_id:
                    if stored.version != version or stored.broken_at is not None:
                        return False
                    self._schedules[stored.name] = dataclasses.replace(
                        stored, broken_at=self.now(), broken_reason=reason
                    )
                    return True
            return False

    def _new_schedule(self, schedule: NewSchedule, now: dt.datetime) -> StoredSchedule:
        return StoredSchedule(
            id=next(self._schedule_ids),
            **{f.name: getattr(schedule, f.name) for f in dataclasses.fields(NewSchedule)},
            paused=False,
            version=0,
            last_nominal_at=None,
            created_at=now,
            updated_at=now,
            disabled_at=None if schedule.enabled else now,
        )

    def _change_schedule(self, stored: StoredSchedule, **changes: Any) -> None:
        self._schedules[stored.name] = dataclasses.replace(
            stored, **changes, version=stored.version + 1, updated_at=self.now()
        )

    def _withdraw(self, schedule_ids: Sequence[int], *, roll_back: set[int]) -> None:
        """Delete the not-yet-due pending occurrences of ``schedule_ids``; for
        those in ``roll_back``, point the cursor at the earliest one deleted."""
        wanted = set(schedule_ids)
        if not wanted:
            return
        now = self.now()
        earliest: dict[int, dt.datetime] = {}
        for job in list(self._jobs.values()):
            sid = job.schedule_id
            if sid in wanted and job.status == JobStatus.PENDING and job.due_at > now:
                del self._jobs[job.id]
                del self._by_key[job.key]
                if sid not in earliest or job.due_at < earliest[sid]:
                    earliest[sid] = job.due_at
        for stored in list(self._schedules.values()):
            if stored.id in roll_back and stored.id in earliest:
                self._schedules[stored.name] = dataclasses.replace(
                    stored, last_nominal_at=None, next_nominal_at=earliest[stored.id]
                )


#: What a user's change writes: the planner tries the schedule again.
_UNBROKEN: dict[str, Any] = {"broken_at": None, "broken_reason": None}


def _refuse_duplicate_names(schedules: Sequence[NewSchedule]) -> None:
    seen: set[str] = set()
    for schedule in schedules:
        if schedule.name in seen:
            raise InvalidSchedule(f"schedule name {schedule.name!r} is given twice")
        seen.add(schedule.name)


def _definition(schedule: NewSchedule) -> dict[str, Any]:
    """The fields ``replace_schedule`` writes: the definition without name,
    source, enabled and the first instant."""
    skip = {"name", "source", "enabled", "next_nominal_at"}
    return {
        f.name: getattr(schedule, f.name)
        for f in dataclasses.fields(NewSchedule)
        if f.name not in skip
    }
