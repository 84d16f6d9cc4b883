"""The leader loop: stage -> pop -> claim -> publish -> plan -> sweep -> reconcile.

One :class:`Engine` runs in each beat process. All of them compete for the
shard's lease through a :class:`~celery_sched.lease.LeaderElector` (renewed on
its own thread); only the holder does any work. :meth:`Engine.step` performs
one pass and returns how long to sleep, so ``celery.beat.Service`` can drive it
from ``Scheduler.tick``.

Failure rules:

- A claim moves rows to ``dispatched`` before anything is published, so a
  crash after the claim leaves them for the reconciler, never lost.
- A job whose own message cannot be published (unroutable, unencodable, its
  queue refused) fails alone: ``attempt + 1`` with the reason, ``dead`` past
  ``max_attempts``. The rest of its batch goes out.
- A broker outage releases the unsent jobs back to ``pending`` (fenced) and
  backs the loop off; if even that write fails, the rows stay ``dispatched``
  and the reconciler requeues them.
- The lease is checked before every publish chunk: once it is gone, the
  unsent jobs are left ``dispatched`` untouched (a stale leader writes
  nothing) for the next leader's reconciler.
- Each duty of a pass (stage, pop, plan, sweep, reconcile, prune) fails on
  its own: any exception is logged with its traceback and counted, the
  other duties still run, and the loop backs off. :meth:`Engine.step`
  never raises.
- Store time is the last time read from the store plus the monotonic time
  since, never the local wall clock: a wall-clock step on the beat host
  cannot make a job look due or expired early.
- A stale epoch (another leader took over) makes the engine step down and
  keep competing; it never exits the process.
- Redis (staging) being down only slows things: the sweep claims straight
  from Postgres.

Periodic schedules (:class:`~celery_sched.planner.Planner`): once elected, the
leader of shard 0 syncs the static schedules (the code's ``beat_schedule``
and decorated tasks) into the store; then every tick the leader materializes
the occurrences of its shard's schedules up to the planning horizon, with a
time budget per pass so dispatching is never held up for long. Occurrences
its stager has already passed are staged at once.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from celery_sched.errors import (
    CelerySchedError,
    InvalidJob,
    InvalidSchedule,
    PublishError,
    StagingUnavailable,
    StaleEpoch,
    StoreError,
)
from celery_sched.timeutil import UTC

if TYPE_CHECKING:
    from celery_sched.interfaces import Dispatcher, JobStore, Ledger, Staging
    from celery_sched.lease import LeaderElector
    from celery_sched.models import Job
    from celery_sched.planner import Planner
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest a failing leader backs off before trying its dependencies again.
MAX_BACKOFF = 5.0
#: A leader pass longer than this many seconds is logged with its breakdown.
SLOW_PASS = 0.5
#: Seconds between pruning rounds (one bounded batch per table each).
HOUSEKEEPING_INTERVAL = 30.0
#: Longest time between rescuer passes, in seconds (a quarter of
#: ``celery_sched_worker_timeout`` when that is shorter).
RESCUE_INTERVAL = 15.0
#: Heartbeat rows are pruned once not seen for this long (or ten worker
#: timeouts, if longer): by then the rescuer has long acted on their jobs.
WORKER_RETENTION = 86400.0
#: While the sweep drains a backlog, staged ids are served every this many batches.
STAGED_EVERY = 4
#: Batches the sweep keeps being claimed, each on its own pooled connection,
#: while it publishes one. With one claim at a time the beat waited on each
#: claim's execution, commit and row transfer: three in flight took dispatch
#: from about 20k to 25-27k jobs/s on a 2-core machine (benchmarks/dispatch.py;
#: four did no better). SKIP LOCKED gives concurrent claims disjoint rows, each
#: the oldest left. Bounded by the pool: one connection always stays free.
CLAIMS_AHEAD = 3
#: Longest one planning pass may run before the loop dispatches again, in seconds.
PLAN_BUDGET = 0.25


@dataclasses.dataclass
class EngineStats:
    """Counters since start; read by ``info``, the CLI and metrics."""

    published: int = 0
    released: int = 0
    expired: int = 0
    requeued: int = 0
    dead: int = 0
    timed_out: int = 0
    staged: int = 0
    claims: int = 0
    elections: int = 0
    step_downs: int = 0
    errors: int = 0
    planned: int = 0
    pruned_jobs: int = 0
    pruned_ledger: int = 0
    #: Running jobs of worker processes that stopped beating (the rescuer);
    #: the requeued and dead among them are in ``requeued`` / ``dead`` too.
    rescued: int = 0
    #: Rescued jobs the idempotency ledger records as completed: succeeded.
    rescued_succeeded: int = 0
    pruned_workers: int = 0
    #: Jobs whose own message could not be published (each counted an attempt).
    rejected: int = 0
    #: Jobs left dispatched because the lease ran out while publishing.
    withheld: int = 0
    #: Failed duties by name (``stage``, ``pop``, ``sweep``, ...): ``errors`` split up.
    failures: dict[str, int] = dataclasses.field(default_factory=dict)


class Engine:
    """One beat process's share of the work for one shard."""

    def __init__(
        self,
        *,
        store: JobStore,
        staging: Staging,
        dispatcher: Dispatcher,
        elector: LeaderElector,
        settings: Settings,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(UTC),
        planner: Planner | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.store = store
        self.planner = planner
        self.ledger = ledger
        self.staging = staging
        self.dispatcher = dispatcher
        self.elector = elector
        self.settings = settings
        self.shard = settings.shard
        self.stats = EngineStats()
        self._clock = clock
        self._wall = wall
        self._epoch: int | None = None
        # (monotonic time, store time read just before it): store time is
        # extrapolated from here with the monotonic clock, so it never runs
        # ahead of the store's (an id popped as due is due by Postgres too
        # when it is claimed), and a step of the wall clock cannot move it.
        self._store_base: tuple[float, dt.datetime] | None = None
        self._staged_until: dt.datetime | None = None
        self._next_stage = 0.0
        self._next_sweep = 0.0
        self._next_reconcile = 0.0
        self._next_plan = 0.0
        self._next_housekeeping = 0.0
        self._next_rescue = 0.0
        self._rescue_interval = max(0.1, min(RESCUE_INTERVAL, settings.worker_timeout / 4))
        self._sync_due = False
        self._backoff = 0.0
        # Frequent small increments: each pass reads and stages only what
        # entered the window since the last one, so no pass stalls the loop.
        self._stage_interval = max(0.25, min(settings.staging_window / 4, 1.0))
        # One pooled connection stays free for the loop's own statements.
        self._claims_ahead = max(1, min(CLAIMS_AHEAD, settings.pool_max_size - 1))
        self._claimer = ThreadPoolExecutor(
            max_workers=self._claims_ahead, thread_name_prefix="celery_sched-claim"
        )

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start competing for the lease (its renewal runs on its own thread)."""
        self.elector.start()

    def stop(self) -> None:
        """Stop competing, release the lease if held, close the broker link."""
        try:
            self.elector.stop()
        finally:
            self._claimer.shutdown(wait=True)
            self.dispatcher.close()

    @property
    def role(self) -> str:
        return "leader" if self._epoch is not None else "standby"

    @property
    def epoch(self) -> int | None:
        return self._epoch

    # -- the loop -----------------------------------------------------------

    def step(self) -> float:
        """Do one pass; return the seconds to sleep before the next one.

        Never raises (but ``KeyboardInterrupt`` / ``SystemExit``): whatever
        a pass throws is logged with its traceback, counted, and backed off.
        """
        try:
            return self._step()
        except Exception as exc:
            # Outside any one duty (a bug, a bad row read by the loop itself):
            # the loop must outlive it, or every beat in turn would exit.
            return self._failed("pass", exc)

    def _step(self) -> float:
        lease = self.elector.current()
        if lease is None:
            if self._epoch is not None:
                self._step_down("lease lost or expired")
            return min(self.settings.max_tick, self.settings.lease_ttl / 3)
        if lease.epoch != self._epoch:
            self._elected(lease.epoch)
        epoch = lease.epoch
        try:
            return self._lead(epoch)
        except StaleEpoch:
            self._step_down(f"epoch {epoch} is stale: another leader took over")
            self.elector.release()
            return 0.0

    def _failed(self, duty: str, exc: BaseException) -> float:
        """Log and count a failed duty; grow the backoff and return it."""
        self.stats.errors += 1
        self.stats.failures[duty] = self.stats.failures.get(duty, 0) + 1
        self._backoff = min(MAX_BACKOFF, max(0.25, self._backoff * 2))
        if isinstance(exc, CelerySchedError):
            # Postgres, Redis or the broker is down: expected, no traceback.
            # Keep the lease (the renewal thread decides that); nothing
            # claimed is lost because claims precede publishing.
            logger.warning(
                "shard %d: %s failed (%s: %s); retrying in %.2fs",
                self.shard,
                duty,
                type(exc).__name__,
                exc,
                self._backoff,
            )
        else:
            logger.error(
                "shard %d: %s failed unexpectedly; retrying in %.2fs",
                self.shard,
                duty,
                self._backoff,
                exc_info=exc,
            )
        return self._backoff

    def _duty(self, name: str, fn: Callable[..., T], *args: Any) -> tuple[bool, T | None]:
        """Run one duty of a pass: ``(True, result)``, or ``(False, None)``
        after logging and counting what it raised. A stale epoch is not a
        failure of the duty: it ends the pass (the engine steps down)."""
        try:
            return True, fn(*args)
        except StaleEpoch:
            raise
        except Exception as exc:
            self._failed(name, exc)
            return False, None

    def _elected(self, epoch: int) -> None:
        self._epoch = epoch
        self._staged_until = None
        self._next_stage = self._next_sweep = self._next_reconcile = self._next_plan = 0.0
        # Shard 0's leader owns the static schedules; syncing them on every
        # election picks up a deploy that changed them.
        self._sync_due = self.planner is not None and self.shard == 0
        self.stats.elections += 1
        logger.info("shard %d: leading with epoch %d", self.shard, epoch)

    def _step_down(self, why: str) -> None:
        logger.warning("shard %d: stepping down (%s)", self.shard, why)
        self._epoch = None
        self._staged_until = None
        self.stats.step_downs += 1

    def _lead(self, epoch: int) -> float:
        now = self._clock()
        timings: list[tuple[str, float]] = []
        more = False
        clean = True
        broker_down = False
        if now >= self._next_stage:
            ok, _ = self._duty("stage", self._stage)
            if ok:
                self._next_stage = now + self._stage_interval
            clean = clean and ok
            timings.append(("stage", self._clock()))
        ok, popped = self._duty("pop", self._pop_and_publish, epoch)
        more = bool(popped)
        clean = clean and ok
        broker_down = not ok
        timings.append(("pop", self._clock()))
        if self.planner is not None and now >= self._next_plan:
            ok, planning = self._duty("plan", self._plan, self.planner)
            # A pass cut short by its budget goes on right after dispatching.
            self._next_plan = now if planning else now + min(self.settings.max_tick, 1.0)
            more = more or bool(planning)
            clean = clean and ok
            timings.append(("plan", self._clock()))
        if now >= self._next_sweep and not broker_down:
            # (After a failed publish the sweep would only fail the same way.)
            ok, swept = self._duty("sweep", self._sweep, epoch)
            more = more or (swept or 0) >= self.settings.batch_size
            self._next_sweep = now + self.settings.sweep_interval
            clean = clean and ok
            timings.append(("sweep", self._clock()))
        # Whatever happened to dispatching, the reconciler and pruning run
        # on their own schedules: a job the broker lost is requeued even
        # while every publish fails.
        if now >= self._next_reconcile:
            ok, _ = self._duty("reconcile", self._reconcile, epoch)
            self._next_reconcile = now + self.settings.reconcile_interval
            clean = clean and ok
            timings.append(("reconcile", self._clock()))
        if now >= self._next_rescue:
            ok, _ = self._duty("rescue", self._rescue, epoch)
            self._next_rescue = now + self._rescue_interval
            clean = clean and ok
            timings.append(("rescue", self._clock()))
        if now >= self._next_housekeeping:
            ok, _ = self._duty("prune", self._housekeeping)
            self._next_housekeeping = now + HOUSEKEEPING_INTERVAL
            clean = clean and ok
            timings.append(("prune", self._clock()))
        if timings and timings[-1][1] - now > SLOW_PASS:
            # A slow pass delays every job due meanwhile; say where it went.
            parts, start = [], now
            for name, at in timings:
                parts.append(f"{name} {at - start:.3f}s")
                start = at
            logger.warning("slow leader pass: %s", ", ".join(parts))
        if not clean:
            # Back off (the caller sleeps this long) instead of hammering a
            # dependency that is down, or a row that fails every time.
            return self._backoff
        self._backoff = 0.0
        if more:
            return 0.0
        return self._sleep_time()

    # -- parts --------------------------------------------------------------

    def store_now(self) -> dt.datetime:
        """Best estimate of the store's clock that never runs ahead of it:
        the last time read from the store plus the monotonic time since."""
        if self._store_base is None:
            return self._measure_store_time()
        at, store_time = self._store_base
        return store_time + dt.timedelta(seconds=max(0.0, self._clock() - at))

    def _measure_store_time(self) -> dt.datetime:
        store_time = self.store.now()
        # Taken after the reply: the extrapolation then trails the store's
        # clock by the round trip, never leads it.
        self._store_base = (self._clock(), store_time)
        return store_time

    def _stage(self) -> None:
        """Copy jobs due within the window into Redis, incrementally."""
        store_now = self._measure_store_time()
        horizon = store_now + dt.timedelta(seconds=self.settings.staging_window)
        limit = max(self.settings.batch_size * 50, 10_000)
        # Only the future is staged: anything already due belongs to the
        # sweep, which claims it from Postgres in bulk.
        items = self.store.due_soon(
            shard=self.shard,
            within=self.settings.staging_window,
            limit=limit,
            after=self._staged_until or store_now,
        )
        try:
            if items:
                self.stats.staged += self.staging.add(self.shard, items)
        except StagingUnavailable as exc:
            # Keep the high-water mark where it was: the next pass retries,
            # and meanwhile the sweep claims straight from Postgres.
            logger.warning("staging unavailable (%s); sweeping from Postgres", exc)
            self._next_sweep = 0.0
            return
        self._staged_until = items[-1][1] if len(items) >= limit else horizon

    def _pop_and_publish(self, epoch: int, drop_through: dt.datetime | None = None) -> bool:
        """Claim and publish staged ids that are due; True if more may be due.

        ``drop_through``: staged ids due by then are discarded unread (see
        :meth:`_sweep`).
        """
        if not self.elector.is_leader():
            return False
        try:
            ids = self.staging.pop_due(
                self.shard, self.store_now(), self.settings.batch_size, drop_through=drop_through
            )
        except StagingUnavailable as exc:
            logger.warning("staging unavailable (%s); sweeping from Postgres", exc)
            self._next_sweep = min(self._next_sweep, self._clock() + self.settings.max_tick)
            # The high-water mark may cover ids a FLUSHALL or restart lost.
            self._staged_until = None
            return False
        if not ids:
            return False
        jobs = self.store.claim_ids(ids, shard=self.shard, epoch=epoch)
        self._publish(jobs, epoch)
        return len(ids) >= self.settings.batch_size

    def _sweep(self, epoch: int) -> int:
        """Claim due pending rows straight from Postgres (the fallback path).

        Through a backlog, the next batches (up to :data:`CLAIMS_AHEAD`) are
        claimed on helper threads while this one is published, so Postgres
        and the broker work at the same time instead of taking turns. Every
        claim is fenced by ``epoch`` on its own; batches claimed ahead when
        the pass fails are released.
        """
        if not self.elector.is_leader():
            return 0
        total = 0
        batches = 0
        batch = self.settings.batch_size
        ahead: collections.deque[Future[list[Job]]] = collections.deque(
            [self._claimer.submit(self._claim_batch, epoch)]
        )
        try:
            while ahead:
                jobs = ahead.popleft().result()
                if len(jobs) >= batch and self.elector.is_leader():
                    # A full batch: there is likely more; keep claims going.
                    while len(ahead) < self._claims_ahead:
                        ahead.append(self._claimer.submit(self._claim_batch, epoch))
                if not jobs:
                    continue  # drain the claims still in flight
                self._publish(jobs, epoch)
                total += len(jobs)
                batches += 1
                if ahead and batches % STAGED_EVERY == 0:
                    # A backlog: let staged (time-critical) ids through too,
                    # though not after every batch. The sweep claims oldest
                    # first, so staged copies due up to this batch's latest
                    # were taken and are dropped unread. A job committed
                    # while that claim ran is claimed by a later batch, or,
                    # if the batches ahead end the sweep, by the next sweep.
                    swept = max(job.due_at for job in jobs)
                    self._pop_and_publish(epoch, drop_through=swept)
        finally:
            for claim in ahead:
                self._release_claimed_ahead(claim, epoch)
        if total:
            logger.info("sweep claimed %d due jobs from Postgres", total)
        return total

    def _plan(self, planner: Planner) -> bool:
        """Sync static schedules if due, then one planning pass; True if more is left."""
        if not self.elector.is_leader():
            return False
        if self._sync_due:
            try:
                synced = planner.sync_static()
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
        planned = planner.plan_pass(
            shard=self.shard, shards=self.settings.shards, budget=PLAN_BUDGET
        )
        self.stats.planned += len(planned.written)
        self._stage_planned(planned.written)
        return planned.more

    def _stage_planned(self, written: Sequence[tuple[uuid.UUID, dt.datetime, int]]) -> None:
        """Stage new occurrences due within the window: the stager only reads
        what lies beyond its high-water mark, and may have passed these."""
        horizon = self.store_now() + dt.timedelta(seconds=self.settings.staging_window)
        items = [(job_id, due) for job_id, due, shard in written if shard == self.shard]
        items = [(job_id, due) for job_id, due in items if due <= horizon]
        if not items:
            return
        try:
            self.stats.staged += self.staging.add(self.shard, items)
        except StagingUnavailable as exc:
            logger.warning("staging unavailable (%s); sweeping from Postgres", exc)
            self._next_sweep = 0.0

    def _claim_batch(self, epoch: int) -> list[Job]:
        return self.store.claim_due(shard=self.shard, epoch=epoch, limit=self.settings.batch_size)

    def _release_claimed_ahead(self, ahead: Future[list[Job]], epoch: int) -> None:
        # The pass failed while a batch was being claimed ahead: hand those
        # jobs back (or, if that fails too, leave them to the reconciler).
        try:
            jobs = ahead.result()
        except Exception:
            return
        if jobs and self._holds(epoch):
            self._settle("release", [job.id for job in jobs], epoch)

    def _holds(self, epoch: int) -> bool:
        """Whether the lease of ``epoch`` is still locally valid (no I/O)."""
        lease = self.elector.current()
        return lease is not None and lease.epoch == epoch

    def _publish(self, jobs: Sequence[Job], epoch: int) -> None:
        if not jobs:
            return
        self.stats.claims += 1
        # A leader paused between claim and publish for longer than its
        # lease must not publish: a successor may have requeued and sent
        # these jobs already. Checked before every chunk.
        result = self.dispatcher.publish(
            jobs, epoch=epoch, now=self.store_now(), may_publish=lambda: self._holds(epoch)
        )
        # (Should publish itself raise, which jobs went out is unknown: they
        # stay dispatched, and the reconciler requeues them with an attempt
        # counted, so a batch that always breaks the dispatcher ends dead
        # instead of being claimed again at once, forever.)
        self.stats.published += len(result.sent)
        if result.withheld:
            self.stats.withheld += len(result.withheld)
            logger.warning(
                "shard %d: the lease of epoch %d ran out while publishing; %d jobs left "
                "dispatched for the next leader's reconciler",
                self.shard,
                epoch,
                len(result.withheld),
            )
        if not self._holds(epoch):
            # A stale leader writes nothing more: the rows stay dispatched.
            return
        if result.expired:
            self._settle("expire", result.expired, epoch)
        if result.rejected:
            self._fail(result.rejected, epoch)
        if result.failed:
            logger.warning("%d jobs failed to publish; releasing them", len(result.failed))
            self._settle("release", result.failed, epoch)
            # The broker is down: back off (step() does) instead of claiming
            # the same jobs again at once.
            raise PublishError(f"broker unavailable: {len(result.failed)} jobs not published")

    def _fail(self, rejected: dict[uuid.UUID, str], epoch: int) -> None:
        """Count a failed publish against each job (dead past max_attempts)."""
        try:
            result = self.store.fail_dispatch(list(rejected.items()), epoch=epoch)
        except StoreError as exc:
            logger.warning(
                "could not record %d failed publishes (%s); the reconciler will requeue them",
                len(rejected),
                exc,
            )
            return
        self.stats.rejected += result.requeued + result.dead
        self.stats.dead += result.dead
        logger.warning(
            "shard %d: %d jobs could not be published (%d requeued with an attempt counted, "
            "%d dead); first: %s",
            self.shard,
            len(rejected),
            result.requeued,
            result.dead,
            next(iter(rejected.values())),
        )

    def _settle(self, action: str, job_ids: Sequence[uuid.UUID], epoch: int) -> None:
        """Finish a transition after publishing; on failure the reconciler will."""
        try:
            if action == "release":
                self.stats.released += self.store.release(job_ids, epoch=epoch)
            else:
                self.stats.expired += self.store.mark_expired(
                    job_ids, epoch=epoch, reason="expired before it was due"
                )
        except StoreError as exc:
            logger.warning(
                "could not %s %d jobs (%s); the reconciler will requeue them",
                action,
                len(job_ids),
                exc,
            )

    def _reconcile(self, epoch: int) -> None:
        result = self.store.reconcile(
            shard=self.shard,
            epoch=epoch,
            limit=self.settings.batch_size * 10,
            default_visibility_timeout=self.settings.visibility_timeout,
        )
        self.stats.requeued += result.requeued
        self.stats.dead += result.dead
        self.stats.timed_out += result.timed_out
        if result.requeued or result.dead or result.timed_out:
            logger.warning(
                "reconciler: requeued %d, dead %d, over max_runtime %d",
                result.requeued,
                result.dead,
                result.timed_out,
            )

    def _rescue(self, epoch: int) -> None:
        """Requeue (or, by the ledger, finish) running jobs of dead worker processes."""
        result = self.store.rescue(
            shard=self.shard,
            epoch=epoch,
            limit=self.settings.batch_size * 10,
            worker_timeout=self.settings.worker_timeout,
        )
        self.stats.requeued += result.requeued
        self.stats.dead += result.dead
        self.stats.rescued += result.rescued
        self.stats.rescued_succeeded += result.succeeded
        if result.rescued:
            logger.warning(
                "rescuer: %d running jobs of stopped workers: requeued %d, dead %d, "
                "succeeded by the ledger %d",
                result.rescued,
                result.requeued,
                result.dead,
                result.succeeded,
            )

    def _housekeeping(self) -> None:
        """Prune finished jobs and completed ledger entries past their retention.

        One bounded batch of each per interval, so a large backlog (after a
        long stop, or a retention just lowered) is worked off gradually and
        never stalls dispatching. Both tables are shared by every shard, so
        only shard 0's leader prunes. A failure is logged, never raised:
        pruning is not worth a step-down.
        """
        if self.shard != 0:
            return
        settings = self.settings
        try:
            if settings.retention > 0:
                self.stats.pruned_jobs += self.store.prune(
                    older_than=settings.retention, batch=settings.prune_batch, max_batches=1
                )
            if self.ledger is not None and settings.ledger_retention > 0:
                self.stats.pruned_ledger += self.ledger.prune(
                    older_than=settings.ledger_retention,
                    batch=settings.prune_batch,
                    max_batches=1,
                )
            self.stats.pruned_workers += self.store.prune_workers(
                older_than=max(WORKER_RETENTION, 10 * settings.worker_timeout)
            )
        except CelerySchedError as exc:
            logger.warning("shard %d: pruning failed, will try again: %s", self.shard, exc)

    def _sleep_time(self) -> float:
        now = self._clock()
        deadlines = [
            self.settings.max_tick,
            self._next_stage - now,
            self._next_sweep - now,
            self._next_reconcile - now,
        ]
        if self.planner is not None:
            deadlines.append(self._next_plan - now)
        try:
            next_due = self.staging.next_due(self.shard)
        except StagingUnavailable:
            next_due = None
        if next_due is not None and self._store_base is not None:
            deadlines.append((next_due - self.store_now()).total_seconds())
        return max(0.0, min(deadlines))
