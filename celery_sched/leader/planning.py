"""Planning: turning periodic schedules into jobs, a time-boxed pass per tick.

Once elected, the leader of shard 0 syncs the static schedules (the code's
``beat_schedule`` and decorated tasks) into the store, so a deploy that
changed them is picked up. Then every tick the leader materializes the
occurrences of its shard's schedules up to the planning horizon, with a time
budget per pass so dispatching is never held up for long. Occurrences its
stager has already passed are staged at once.

Failures: a static schedule that fails validation is logged at ERROR with
its name and left out of the sync (so its stored row, if any, is disabled as
if removed from the code) and not retried until the next election (they were
checked when beat started; retrying cannot help); the others are synced.
Anything else the planner raises propagates: the loop logs and counts a
failed ``plan`` and tries again after its backoff.

The planner
-----------

The leader runs :meth:`Planner.plan_pass` every tick. It reads the schedules
whose next instant enters the horizon (``celery_sched_plan_horizon`` seconds
ahead of the store's clock), asks :func:`celery_sched.schedules.plan` which
occurrences to materialize, and commits, per batch and in one transaction,
the new job rows (one per occurrence, keyed
``schedules.occurrence_key(name, nominal)``) and each schedule's new cursor.
The staging and dispatch path then treats them like any other job.

Why this is safe to run twice at once (an old leader that has not noticed
yet, and the new one): occurrence keys are unique, so a racing planner skips
what the other wrote; and a schedule's cursor only moves if the schedule
still has the version the planner read, so a user's change (which bumps the
version and withdraws the not-yet-due occurrences) is never overwritten by a
plan made from the old definition.

The next occurrence is always computed from the previous *nominal* instant
(the cursor), never from when the planner ran, so nothing drifts.

Overlap ``skip`` schedules are planned one occurrence at a time: the next
one is materialized only once the previous one finished; if the previous is
still unfinished when the next instant arrives, that instant is skipped.

A schedule whose stored row cannot be planned (a definition that no longer
evaluates, an ``expires`` past the latest date, a corrupt spec, a kind this
code does not know) fails alone: it is marked broken with the reason, the
rest of the pass goes on, and later passes leave it out until a user changes
or resumes it. Otherwise one row would fail every pass of every leader.

Custom schedules (any object beat drives through ``is_due``,
:mod:`celery_sched.schedules.custom`) exist only in the code: their row
records the class and repr, and the planner evaluates the object of the
static spec of the same name and definition. A custom row this beat has no
such object for (a beat still running older code during a deploy) is left
alone, not marked broken: it is logged at ERROR once and planned by the
first leader whose code has it, without anyone having to resume it. An
object that raises or is never due is set aside as broken like any other.
A new custom row's first instant is computed when it is first planned, as
beat computes it from its start (``last_run_at`` = now): no cursor can be
derived from a stored instant of an arbitrary object.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from celery_sched import schedules
from celery_sched.errors import CelerySchedError, InvalidJob, InvalidSchedule
from celery_sched.ids import UUID7Source
from celery_sched.interfaces import JobStore
from celery_sched.models import (
    MisfirePolicy,
    NewJob,
    OverlapPolicy,
    ScheduleAdvance,
    ScheduleSpec,
    StoredSchedule,
    SyncResult,
)
from celery_sched.schedules.rows import (
    broken_reason,
    cursor_before,
    occurrence_job,
    schedule_row,
    spec_of,
)
from celery_sched.settings import Settings
from celery_sched.validation import JobBuilder

if TYPE_CHECKING:
    from celery_sched.leader.staging import Stager
    from celery_sched.leader.stats import EngineStats
    from celery_sched.lease.elector import LeaderElector

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PassResult:
    """What one :meth:`Planner.plan_pass` did.

    ``written`` holds ``(id, due_at, shard)`` of every occurrence inserted,
    for the engine to stage those its stager has already passed. ``more``
    is true when the pass stopped at its time budget with schedules left.
    ``broken`` counts the schedules this pass marked broken; ``absent`` the
    custom schedules left alone because this beat's code has no object for
    them.
    """

    schedules: int = 0
    written: list[tuple[Any, dt.datetime, int]] = dataclasses.field(default_factory=list)
    skipped: int = 0
    busy: int = 0
    stale: int = 0
    broken: int = 0
    absent: int = 0
    more: bool = False


@dataclasses.dataclass
class PlannerStats:
    """Counters since start (``info``, the CLI, tests)."""

    passes: int = 0
    schedules: int = 0
    occurrences: int = 0
    skipped: int = 0
    busy: int = 0
    stale: int = 0
    broken: int = 0
    absent: int = 0
    syncs: int = 0


class Planner:
    """Materializes the occurrences of stored schedules, and syncs the static ones.

    ``static`` are the schedules the code defines (``beat_schedule`` and
    decorated tasks, :func:`celery_sched.schedules.specs_from_app`);
    :meth:`sync_static` writes them, and custom schedules among them are
    evaluated from their objects. ``app`` serializes their arguments and
    decides job shards; ``clock`` (monotonic seconds) bounds a pass.
    """

    def __init__(
        self,
        store: JobStore,
        settings: Settings,
        *,
        app: Any,
        static: Sequence[ScheduleSpec] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.settings = settings
        self.app = app
        self.static = list(static)
        self._custom = {spec.name: spec for spec in self.static if spec.kind == "custom"}
        self._absent_logged: set[str] = set()
        self.stats = PlannerStats()
        self._clock = clock
        self._builder: JobBuilder | None = None
        self._ids = UUID7Source()
        self._default_misfire = MisfirePolicy(settings.misfire_policy)

    @property
    def builder(self) -> JobBuilder:
        if self._builder is None:
            self._builder = JobBuilder(self.app, self.settings)
        return self._builder

    # -- static schedules ---------------------------------------------------

    def sync_static(self) -> SyncResult:
        """Make the stored static schedules match :attr:`static` (one transaction).

        New ones are added, changed ones replaced, those gone from the code
        disabled (history kept); dynamic schedules are left alone, also when
        a static one has their name (logged as a conflict).
        """
        now = self.store.now()
        rows = []
        for spec in self.static:
            try:
                rows.append(schedule_row(spec, self.builder, now=now))
            except CelerySchedError as exc:
                # One schedule (a custom object that fails when asked, say)
                # must not keep the others out of the store.
                logger.error(
                    "static schedule %r not synced (disabled if stored) until the next "
                    "election: %s",
                    spec.name,
                    exc,
                )
        result = self.store.sync_static_schedules(rows)
        self.stats.syncs += 1
        if result.conflicts:
            shown = ", ".join(repr(name) for name in result.conflicts[:10])
            logger.warning(
                "%d static schedule(s) not synced: the name is taken by a schedule created "
                "through the API (%s); rename one of them",
                len(result.conflicts),
                shown,
            )
        return result

    # -- occurrences ----------------------------------------------------------

    def plan_pass(
        self, *, shard: int = 0, shards: int = 1, budget: float | None = None
    ) -> PassResult:
        """Materialize every occurrence up to the horizon of the schedules of
        ``shard`` (``id % shards``), in batches of ``plan_batch_size``.

        Stops early, with ``more`` set, once ``budget`` seconds have passed,
        so the leader loop stays responsive; the next pass goes on.
        """
        settings = self.settings
        now = self.store.now()
        horizon = now + dt.timedelta(seconds=settings.plan_horizon)
        deadline = None if budget is None else self._clock() + budget
        batch = settings.plan_batch_size
        # Built here, outside the per-schedule guard: a builder that cannot be
        # made fails the pass, it must not mark every schedule broken.
        _ = self.builder
        after: tuple[dt.datetime, int] | None = None
        totals = {"schedules": 0, "skipped": 0, "busy": 0, "stale": 0, "broken": 0, "absent": 0}
        written: list[tuple[Any, dt.datetime, int]] = []
        more = False
        while True:
            rows = self.store.due_schedules(
                horizon=horizon, shard=shard, shards=shards, limit=batch, after=after
            )
            if not rows:
                break
            last = rows[-1]
            assert last.next_nominal_at is not None  # only such rows are due
            after = (last.next_nominal_at, last.id)
            guarded = [row.id for row in rows if row.overlap == OverlapPolicy.SKIP]
            busy = self.store.busy_schedules(guarded) if guarded else set()
            advances: list[ScheduleAdvance] = []
            for row in rows:
                try:
                    advance, skipped = self._advance(row, now, horizon, busy=row.id in busy)
                except _NoObject as exc:
                    totals["absent"] += 1
                    self._log_absent(row, exc)
                    continue
                except Exception as exc:  # any error of one row stays that row's
                    totals["broken"] += self._set_aside(row, exc)
                    continue
                totals["skipped"] += skipped
                if advance is not None:
                    advances.append(advance)
            commit = self.store.commit_plans(advances)
            written.extend(commit.written)
            totals["schedules"] += len(rows)
            totals["busy"] += commit.busy
            totals["stale"] += commit.stale
            if len(rows) < batch:
                break
            if deadline is not None and self._clock() >= deadline:
                more = True
                break
        result = PassResult(written=written, more=more, **totals)
        self._count(result)
        return result

    def _set_aside(self, row: StoredSchedule, exc: Exception) -> int:
        """Mark ``row`` broken because planning it raised ``exc``; 1 if marked,
        0 if a user changed it meanwhile (their version is planned next pass)."""
        reason = broken_reason(exc)
        # Our own errors name the problem; anything else may be a bug here.
        logger.error(
            "schedule %r cannot be planned and is set aside as broken until it is "
            "changed or resumed: %s",
            row.name,
            reason,
            exc_info=not isinstance(exc, CelerySchedError),
        )
        return int(self.store.mark_schedule_broken(row.id, version=row.version, reason=reason))

    def _log_absent(self, row: StoredSchedule, exc: _NoObject) -> None:
        if row.name in self._absent_logged:
            return
        self._absent_logged.add(row.name)
        logger.error(
            "custom schedule %r is left for a beat whose code has it: %s", row.name, exc.reason
        )

    def spec_for(self, row: StoredSchedule) -> ScheduleSpec:
        """The spec to plan ``row`` by: the stored one, or for a custom
        schedule the code's, whose definition carries the object."""
        spec = spec_of(row)
        if spec.kind != "custom":
            return spec
        static = self._custom.get(row.name)
        if row.source != "static":
            raise _NoObject(f"it is not a static schedule (source {row.source!r})")
        if static is None:
            raise _NoObject("no beat_schedule entry or decorated task of this beat has that name")
        if dict(static.spec) != dict(row.spec):
            raise _NoObject(
                f"this beat's code has {dict(static.spec)}, the stored row {dict(row.spec)}"
            )
        return dataclasses.replace(spec, spec=static.spec)

    def _advance(
        self, row: StoredSchedule, now: dt.datetime, horizon: dt.datetime, *, busy: bool
    ) -> tuple[ScheduleAdvance | None, int]:
        """One schedule's step (``None``: leave it as it is) and how many
        occurrences it skipped."""
        assert row.next_nominal_at is not None
        s = self.settings
        spec = self.spec_for(row)
        cursor = row.last_nominal_at
        if cursor is None and spec.kind != "custom":
            cursor = cursor_before(spec, row.next_nominal_at)
        one_at_a_time = spec.overlap is OverlapPolicy.SKIP
        if one_at_a_time and busy:
            if row.next_nominal_at > now:
                return None, 0  # wait: the previous one may finish in time
            # The previous occurrence is still unfinished at this one's
            # time: overlap "skip" drops every instant up to now.
            skip = MisfirePolicy.SKIP
            plan = self._plan(
                dataclasses.replace(spec, misfire=skip), cursor, now, now, skip, s.plan_batch_size
            )
            advance = ScheduleAdvance(
                schedule_id=row.id,
                version=row.version,
                last_nominal_at=plan.cursor,
                next_nominal_at=plan.next_nominal,
            )
            return advance, plan.skipped + len(plan.occurrences)
        limit = 1 if one_at_a_time else s.plan_batch_size
        plan = self._plan(spec, cursor, now, horizon, self._default_misfire, limit)
        occurrences = plan.occurrences
        last_nominal, next_nominal = plan.cursor, plan.next_nominal
        if one_at_a_time and len(occurrences) > 1:
            # One at a time: the rest stay ahead of the cursor and are
            # planned once this one has finished.
            occurrences = occurrences[:1]
            last_nominal = occurrences[0]
            next_nominal = schedules.next_after(spec, last_nominal)
        jobs = [self._occurrence(row, nominal, now) for nominal in occurrences]
        advance = ScheduleAdvance(
            schedule_id=row.id,
            version=row.version,
            last_nominal_at=last_nominal,
            next_nominal_at=next_nominal,
            occurrences=jobs,
            skip_if_busy=one_at_a_time,
        )
        return advance, plan.skipped

    def _plan(
        self,
        spec: ScheduleSpec,
        cursor: dt.datetime | None,
        now: dt.datetime,
        horizon: dt.datetime,
        default_misfire: MisfirePolicy,
        limit: int,
    ) -> schedules.Plan:
        """:func:`celery_sched.schedules.plan` with this planner's settings."""
        s = self.settings
        return schedules.plan(
            spec,
            last_nominal=cursor,
            now=now,
            horizon=horizon,
            default_misfire=default_misfire,
            catchup_window=s.catchup_window,
            max_catchup=s.max_catchup,
            grace=s.misfire_grace,
            limit=limit,
        )

    def _occurrence(self, row: StoredSchedule, nominal: dt.datetime, now: dt.datetime) -> NewJob:
        return occurrence_job(
            row,
            nominal,
            now=now,
            job_id=self._ids.next(),
            max_attempts=self.settings.max_attempts,
            shard_of=self.builder.shard_of,
        )

    def _count(self, result: PassResult) -> None:
        stats = self.stats
        stats.passes += 1
        stats.schedules += result.schedules
        stats.occurrences += len(result.written)
        stats.skipped += result.skipped
        stats.busy += result.busy
        stats.stale += result.stale
        stats.broken += result.broken
        stats.absent += result.absent


class _NoObject(CelerySchedError):
    """This planner has no object to evaluate the custom schedule's row by."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


#: Longest one planning pass may run before the loop dispatches again, in seconds.
PLAN_BUDGET = 0.25


class Planning:
    """Drives one shard's :class:`Planner` from the loop."""

    def __init__(
        self,
        planner: Planner,
        *,
        elector: LeaderElector,
        settings: Settings,
        stats: EngineStats,
        stager: Stager,
    ) -> None:
        self._planner = planner
        self._elector = elector
        self._stats = stats
        self._stager = stager
        self._shard = settings.engine_shard
        self._shards = settings.shards
        #: Seconds between passes once a pass finished within its budget (a
        #: pass cut short goes on right after dispatching).
        self.interval = min(settings.max_tick, 1.0)
        self._sync_due = False

    def elected(self) -> None:
        """Shard 0's leader owns the static schedules: sync them on every
        election, which picks up a deploy that changed them."""
        self._sync_due = self._shard == 0

    def run(self) -> bool:
        """Sync static schedules if due, then one planning pass; True if more is left."""
        if not self._elector.is_leader():
            return False
        if self._sync_due:
            try:
                synced = self._planner.sync_static()
            except (InvalidSchedule, InvalidJob) as exc:
                # The code's schedules were checked when beat started, so this
                # is rare; retrying cannot help, dispatching must go on.
                logger.error("static schedules not synced: %s", exc)
            else:
                logger.info(
                    "static schedules synced: %d added, %d changed, %d disabled, %d unchanged",
                    synced.added,
                    synced.updated,
                    synced.disabled,
                    synced.unchanged,
                )
            self._sync_due = False
        planned = self._planner.plan_pass(
            shard=self._shard, shards=self._shards, budget=PLAN_BUDGET
        )
        self._stats.planned += len(planned.written)
        self._stager.stage_planned(planned.written)
        return planned.more
