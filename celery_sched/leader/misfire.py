"""Misfire at dispatch: occurrences planned ahead that a leader sends late.

The planner materializes occurrences up to ``celery_sched_plan_horizon``
ahead and applies the misfire policy only to what is already late when it
plans. An occurrence planned ahead of its time and then left unsent (the
leaders were down, paused or backlogged) is judged when it is first
claimed instead: late by more than ``celery_sched_misfire_grace``, it is
sent only if its schedule's policy keeps it
(:func:`celery_sched.schedules.kept_late`: ``skip`` none, ``once`` the
latest instant missed, ``all`` the catch-up window's); the others become
``missed`` and are never sent. Each occurrence is judged once: at planning
if it was late then (those and triggered runs were created at or after
their due time), else here. A requeue (``attempt`` above 0) is never
judged: it follows ``max_attempts``.

Cost: one test per claimed job while nothing is late; late occurrences
read their schedules, one query per batch.

Failures: should the schedules not be read, a schedule not evaluate (a
custom schedule whose object this beat's code lacks) or the marking fail,
the late occurrences are sent (logged): a late run is what they were
planned for, a lost one is not recoverable.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from celery_sched.errors import CelerySchedError
from celery_sched.models import DueSpan, MisfirePolicy
from celery_sched.schedules import kept_late

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore
    from celery_sched.leader.stats import EngineStats
    from celery_sched.models import Job, ScheduleSpec, StoredSchedule
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)


class LateOccurrences:
    """Drops, from a claimed batch, the late occurrences the misfire policy
    does not run. ``spec_for`` turns a stored schedule into the spec to
    evaluate (the planner's, which knows this beat's custom schedules)."""

    def __init__(
        self,
        *,
        store: JobStore,
        settings: Settings,
        stats: EngineStats,
        spec_for: Callable[[StoredSchedule], ScheduleSpec],
    ) -> None:
        self._store = store
        self._stats = stats
        self._spec_for = spec_for
        self._grace = dt.timedelta(seconds=settings.misfire_grace)
        self._default = MisfirePolicy(settings.misfire_policy)
        self._window = settings.catchup_window
        self._most = settings.max_catchup
        self._shard = settings.engine_shard

    def drop_missed(self, jobs: Sequence[Job], epoch: int, now: dt.datetime) -> Sequence[Job]:
        """``jobs`` without the late occurrences the policy drops, which are
        marked ``missed`` (fenced by ``epoch``) and counted."""
        cutoff = now - self._grace
        late = [
            job
            for job in jobs
            if job.schedule_id is not None
            and job.due_at < cutoff
            and job.attempt == 0
            and job.created_at is not None
            and job.created_at < job.due_at
        ]
        if not late:
            return jobs
        dropped = self._judge(late, now)
        if not dropped:
            return jobs
        try:
            due = DueSpan.of(job.due_at for job in late)
            moved = set(self._store.mark_missed(dropped, epoch=epoch, due=due))
        except CelerySchedError as exc:
            logger.warning(
                "could not mark %d late occurrences missed (%s); sending them", len(dropped), exc
            )
            return jobs
        if not moved:
            return jobs
        self._stats.missed += len(moved)
        logger.info(
            "shard %d: %d late occurrences not sent (misfire policy); first: %s",
            self._shard,
            len(moved),
            next(reason for job_id, reason in dropped if job_id in moved),
        )
        return [job for job in jobs if job.id not in moved]

    def _judge(self, late: list[Job], now: dt.datetime) -> list[tuple[uuid.UUID, str]]:
        """``(id, reason)`` of the late occurrences whose policy drops them."""
        groups: dict[int, list[Job]] = {}
        for job in late:
            assert job.schedule_id is not None
            groups.setdefault(job.schedule_id, []).append(job)
        try:
            rows = self._store.schedules_by_id(list(groups))
        except CelerySchedError as exc:
            logger.warning("could not read the schedules of %d late jobs (%s)", len(late), exc)
            return []
        dropped = []
        for schedule_id, group in groups.items():
            row = rows.get(schedule_id)
            if row is None:  # deleted since: its occurrence was planned, send it
                continue
            try:
                spec = self._spec_for(row)
                kept = kept_late(
                    spec,
                    [job.due_at for job in group],
                    now=now,
                    default_misfire=self._default,
                    catchup_window=self._window,
                    max_catchup=self._most,
                    grace=self._grace.total_seconds(),
                )
            except CelerySchedError as exc:
                logger.warning(
                    "schedule %r: late occurrences sent, its misfire policy could not be "
                    "applied: %s",
                    row.name,
                    exc,
                )
                continue
            policy = (spec.misfire or self._default).value
            for job in group:
                if job.due_at not in kept:
                    late_by = (now - job.due_at).total_seconds()
                    dropped.append((job.id, _reason(policy, late_by)))
        return dropped


def _reason(policy: str, late_by: float) -> str:
    why = {
        "skip": "skip runs no missed occurrence",
        "once": "once runs only the latest occurrence missed",
        "all": "all runs only the latest max_catchup within catchup_window",
    }[policy]
    return f"missed: {late_by:.1f} s late at its first dispatch; misfire {why}"
