"""The leader loop: stage -> pop -> plan -> sweep -> reconcile -> rescue -> prune -> rehome
-> backlog -> presence.

One :class:`Engine` runs per shard a beat process competes for (a
:class:`~celery_sched.leader.fleet.Fleet` keeps them). The engines of one
shard, one per competing beat, compete for its lease through a
:class:`~celery_sched.lease.elector.LeaderElector` (renewed on its own
thread); only the holder does any work. :meth:`Engine.step`
performs one pass on the caller's thread and returns how long to sleep, so
``celery.beat.Service`` can drive it from ``Scheduler.tick``. Each duty has a
module of its own in this package, and its interval there; this one only
keeps their timers and runs whichever are due.

Failure rules (each duty's module says what its own failure does):

- Each duty of a pass (stage, pop, plan, sweep, reconcile, rescue, prune, rehome)
  fails on its own: any exception is logged with its traceback and counted,
  the other duties still run, and the loop backs off. :meth:`Engine.step`
  never raises.
- Whatever happened to dispatching, the reconciler, the rescuer and pruning
  run on their own schedules: a job the broker lost is requeued even while
  every publish fails.
- A stale epoch (another leader took over) makes the engine step down and
  keep competing; it never exits the process.
- Store time is the last time read from the store plus the monotonic time
  since (:class:`~celery_sched.leader.clock.StoreClock`), never the local
  wall clock.
- Redis (staging) being down only slows things: the sweep claims straight
  from Postgres.
"""

from __future__ import annotations

import datetime as dt
import gc
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery_sched.errors import CelerySchedError, StagingUnavailable, StaleEpoch
from celery_sched.leader.backlog import Backlog, BacklogReader
from celery_sched.leader.claiming import Claimer
from celery_sched.leader.clock import StoreClock
from celery_sched.leader.housekeeping import Housekeeper
from celery_sched.leader.misfire import LateOccurrences
from celery_sched.leader.planning import Planning
from celery_sched.leader.presence import Presence
from celery_sched.leader.publishing import Publisher
from celery_sched.leader.reconciler import Reconciler
from celery_sched.leader.rehoming import Rehoming
from celery_sched.leader.rescuer import Rescuer
from celery_sched.leader.staging import Stager
from celery_sched.leader.stats import EngineStats
from celery_sched.leader.sweeping import Sweeper
from celery_sched.schedules.rows import spec_of
from celery_sched.timeutil import UTC
from celery_sched.validation import shard_of_key

if TYPE_CHECKING:
    from celery_sched.interfaces import Dispatcher, JobStore, LeaderBoard, Ledger, Staging
    from celery_sched.leader.planning import Planner
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest a failing leader backs off before trying its dependencies again.
MAX_BACKOFF = 5.0
#: A leader pass longer than this many seconds is logged with its breakdown.
SLOW_PASS = 0.5


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
        board: LeaderBoard | None = None,
        stats: EngineStats | None = None,
        owns_dispatcher: bool = True,
    ) -> None:
        self.store = store
        self.planner = planner
        self.ledger = ledger
        self.staging = staging
        self.dispatcher = dispatcher
        self.elector = elector
        self.settings = settings
        self.shard = settings.engine_shard
        # (Given by a fleet that keeps a shard's counters across engines.)
        self.stats = EngineStats() if stats is None else stats
        self._owns_dispatcher = owns_dispatcher
        self._clock = clock
        self._wall = wall
        self._epoch: int | None = None
        self._last_epoch = 0
        self._backoff = 0.0
        # The duties' timers: monotonic times at which each is next due.
        self._next_stage = 0.0
        self._next_sweep = 0.0
        self._next_reconcile = 0.0
        self._next_plan = 0.0
        self._next_housekeeping = 0.0
        self._next_rehome = 0.0
        self._next_rescue = 0.0
        self._next_backlog = 0.0

        stats = self.stats
        # Alive from the start: the first pass has not had its chance yet.
        stats.progress_at = clock()
        self._store_clock = StoreClock(store, clock)
        publisher = Publisher(
            store=store,
            dispatcher=dispatcher,
            elector=elector,
            store_clock=self._store_clock,
            stats=stats,
            shard=self.shard,
            late=LateOccurrences(
                store=store,
                settings=settings,
                stats=stats,
                spec_for=spec_of if planner is None else planner.spec_for,
            ),
        )
        self._stager = Stager(
            store=store,
            staging=staging,
            settings=settings,
            store_clock=self._store_clock,
            stats=stats,
            sweep_by=self._sweep_by,
        )
        self._claimer = Claimer(
            store=store,
            staging=staging,
            elector=elector,
            settings=settings,
            store_clock=self._store_clock,
            stager=self._stager,
            publisher=publisher,
            clock=clock,
            stats=stats,
        )
        self._sweeper = Sweeper(
            store=store,
            elector=elector,
            settings=settings,
            publisher=publisher,
            claimer=self._claimer,
            stats=stats,
        )
        self._planning = (
            None
            if planner is None
            else Planning(
                planner, elector=elector, settings=settings, stats=stats, stager=self._stager
            )
        )
        self._reconciler = Reconciler(store, settings, stats)
        self._rescuer = Rescuer(store, settings, stats)
        self._housekeeper = Housekeeper(store, settings, stats, ledger)
        shards = settings.shards
        self._rehoming = Rehoming(
            store=store,
            staging=staging,
            settings=settings,
            store_clock=self._store_clock,
            stats=stats,
            shard_of=lambda key: shard_of_key(key, shards),
        )
        self._presence = (
            None
            if board is None
            else Presence(board, shard=self.shard, store_clock=self._store_clock, clock=clock)
        )
        self._backlog = BacklogReader(
            store=store,
            staging=staging,
            settings=settings,
            store_clock=self._store_clock,
            clock=clock,
        )

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start competing for the lease (its renewal runs on its own thread)."""
        self.elector.start()

    def stop(self) -> None:
        """Stop competing, release the lease if held, close the broker link
        (unless it is shared: ``owns_dispatcher=False``). Call it between two
        passes: the pass in progress has published what it claimed."""
        try:
            self.elector.stop()
        finally:
            self._epoch = None
            self._backlog.close()
            self._sweeper.close()
            if self._owns_dispatcher:
                self.dispatcher.close()

    @property
    def role(self) -> str:
        return "leader" if self._epoch is not None else "standby"

    @property
    def epoch(self) -> int | None:
        return self._epoch

    @property
    def last_epoch(self) -> int:
        """The epoch of the last lease this engine held (0: none yet)."""
        return self._last_epoch

    @property
    def backlog(self) -> Backlog:
        """The leader's last reading of the backlog (empty while standing by)."""
        return self._backlog.last

    def stalled_for(self) -> float:
        """Seconds since the loop last showed progress: a pass ended, or a
        batch of a long pass went out."""
        return max(0.0, self._clock() - self.stats.progress_at)

    def store_now(self) -> dt.datetime:
        """Best estimate of the store's clock that never runs ahead of it."""
        return self._store_clock.now()

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
        finally:
            self.stats.progress_at = self._clock()

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
        freeze_heap_once()
        self._epoch = self._last_epoch = epoch
        self._stager.elected()
        self._next_stage = self._next_sweep = self._next_reconcile = self._next_plan = 0.0
        self._next_backlog = self._next_rehome = 0.0
        self._rehoming.elected()
        if self._planning is not None:
            self._planning.elected()
        if self._presence is not None:
            self._presence.elected()
        self.stats.elections += 1
        logger.info("shard %d: leading with epoch %d", self.shard, epoch)

    def _step_down(self, why: str) -> None:
        logger.warning("shard %d: stepping down (%s)", self.shard, why)
        self._epoch = None
        self._stager.rewind()
        self._backlog.forget()
        self.stats.step_downs += 1

    def _sweep_by(self, deadline: float) -> None:
        """Bring the next sweep forward to ``deadline`` (monotonic) at the latest."""
        self._next_sweep = min(self._next_sweep, deadline)

    def _lead(self, epoch: int) -> float:
        now = self._clock()
        timings: list[tuple[str, float]] = []
        more = False
        clean = True
        broker_down = False
        if now >= self._next_stage:
            ok, _ = self._duty("stage", self._stager.stage)
            if ok:
                self._next_stage = now + self._stager.interval
            clean = clean and ok
            timings.append(("stage", self._clock()))
        ok, popped = self._duty("pop", self._claimer.pop_and_publish, epoch)
        more = bool(popped)
        clean = clean and ok
        broker_down = not ok
        timings.append(("pop", self._clock()))
        if self._planning is not None and now >= self._next_plan:
            ok, planning = self._duty("plan", self._planning.run)
            # A pass cut short by its budget goes on right after dispatching.
            self._next_plan = now if planning else now + self._planning.interval
            more = more or bool(planning)
            clean = clean and ok
            timings.append(("plan", self._clock()))
        if now >= self._next_sweep and not broker_down:
            # (After a failed publish the sweep would only fail the same way.)
            ok, swept = self._duty("sweep", self._sweeper.sweep, epoch)
            more = more or (swept or 0) >= self._sweeper.batch_size
            self._next_sweep = now + self._sweeper.interval
            clean = clean and ok
            timings.append(("sweep", self._clock()))
        # Whatever happened to dispatching, the reconciler and pruning run
        # on their own schedules: a job the broker lost is requeued even
        # while every publish fails.
        if now >= self._next_reconcile:
            ok, reconciling = self._duty("reconcile", self._reconciler.run, epoch)
            # A pass cut into slices goes on right after dispatching.
            self._next_reconcile = now if reconciling else now + self._reconciler.interval
            more = more or bool(reconciling)
            clean = clean and ok
            timings.append(("reconcile", self._clock()))
        if now >= self._next_rescue:
            ok, _ = self._duty("rescue", self._rescuer.run, epoch)
            self._next_rescue = now + self._rescuer.interval
            clean = clean and ok
            timings.append(("rescue", self._clock()))
        if now >= self._next_housekeeping:
            ok, _ = self._duty("prune", self._housekeeper.run)
            self._next_housekeeping = now + self._housekeeper.interval
            clean = clean and ok
            timings.append(("prune", self._clock()))
        if now >= self._next_rehome:
            # (Shard 0's leader only; every other leader returns at once.)
            ok, rehoming = self._duty("rehome", self._rehoming.run)
            # A pass cut short by its bound goes on right after dispatching.
            self._next_rehome = now if rehoming else now + self._rehoming.interval
            more = more or bool(rehoming)
            clean = clean and ok
            timings.append(("rehome", self._clock()))
        if now >= self._next_backlog:
            # Only read for the gauges, on a thread of its own: a failure is
            # logged and counted but does not hold dispatching back.
            self._duty("backlog", self._backlog.run)
            self._next_backlog = now + self._backlog.interval
            timings.append(("backlog", self._clock()))
        if self._presence is not None:
            # For operators only (sched leader); it never fails the pass.
            self._presence.run(epoch)
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

    def _sleep_time(self) -> float:
        now = self._clock()
        deadlines = [
            self.settings.max_tick,
            self._next_stage - now,
            self._next_sweep - now,
            self._next_reconcile - now,
        ]
        if self._planning is not None:
            deadlines.append(self._next_plan - now)
        try:
            next_due = self.staging.next_due(self.shard)
        except StagingUnavailable:
            next_due = None
        if next_due is not None and self._store_clock.measured:
            deadlines.append((next_due - self._store_clock.now()).total_seconds())
        return max(0.0, min(deadlines))


_heap_frozen = False
#: The young generation's collection threshold once leading: above the
#: container objects of the batches in flight (a claim of 1,000 jobs makes
#: about 5,000; up to four are held), so a collection comes from garbage
#: piling up, not from dispatching. Cyclic garbage waits at most this many
#: allocations more (a few megabytes).
YOUNG_GC_THRESHOLD = 50_000


def freeze_heap_once() -> None:
    """Move what the process holds when it first leads out of the cyclic
    garbage collector's reach (``gc.freeze``), once per process.

    Dispatching allocates a dozen container objects per job (the claimed
    row, its job, message and headers); they outlive a batch's young
    collections, so the collector's older generations keep being walked,
    and each full walk crosses the whole heap of a beat: Celery, Kombu,
    SQLAlchemy, the compiled statements. That was 10-15% of the beat's CPU
    while dispatching (py-spy over benchmarks/dispatch.py). The young
    generation's threshold is raised to :data:`YOUNG_GC_THRESHOLD` (never
    lowered): the batches in flight hold a few tens of thousands of
    objects, all freed by reference counting, and at the default 700 the
    collector walked them every ~100 jobs for nothing (0.8 us per job of
    the 4-5 left after the freeze, measured in one process). Frozen objects
    are still freed by reference counting; only a cycle among them that
    later becomes garbage is kept, and what the process holds at its first
    election is its long-lived state. Collected first, so no garbage of
    the start-up is frozen with it.
    """
    global _heap_frozen
    if _heap_frozen:
        return
    _heap_frozen = True
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if young < YOUNG_GC_THRESHOLD:
        gc.set_threshold(YOUNG_GC_THRESHOLD, *older)
