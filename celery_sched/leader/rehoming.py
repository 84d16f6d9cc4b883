"""Rehoming: moving job rows to the shard their key hashes to when
``celery_sched_shards`` changed.

A job's shard is fixed at insert (``crc32(key) % shards``). Lowered, the
count strands the rows of the shards dropped: no beat leads them, so they
would never be dispatched or requeued. Raised, it leaves old rows in the
shards they were written to: still led, only unbalanced. Shard 0's leader
(the tables are shared, as for pruning) therefore:

- every interval, moves rows stranded in shards ``>= shards``, soonest due
  first, a bounded number of batches per pass (a cheap read: the pending
  index leads with shard);
- when the count recorded in ``placement`` differs from its own, walks every
  unfinished row in id order, a batch per transaction and a bounded number
  per pass, moving the misplaced ones; at the end it records the count, so
  the full pass runs once per change, not every pass.

A moved pending row due within the staging window is also staged for its
new shard, so that shard's leader pops it on time; otherwise its sweep
claims it from Postgres. Moving needs no global lock (see
:meth:`~celery_sched.interfaces.Jobs.rehome`).
``celery -A proj sched reshard`` runs :func:`reshard`, the same pass at once.

Failures: whatever the store raises propagates; the batch that failed moved
nothing (one transaction), the loop logs and counts a failed ``rehome``, and
the next pass goes on from the same place. Staging a moved row is only a
speed-up: Redis being down is logged and ignored.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from celery_sched.errors import StagingUnavailable
from celery_sched.models import JobStatus, Rehomed, RehomeResult

if TYPE_CHECKING:
    from celery_sched.interfaces import Jobs, Staging
    from celery_sched.leader.clock import StoreClock
    from celery_sched.leader.stats import EngineStats
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Seconds between rehoming passes of shard 0's leader.
REHOME_INTERVAL = 1.0
#: Seconds between looks for stranded jobs in flight (dispatched, running,
#: retrying). That scan reads every job in flight (their indexes do not lead
#: with the shard), so it runs less often than the pending one, which is one
#: index probe; a job in flight only needs its new shard's reconciler, which
#: waits a visibility timeout (300 s by default) anyway.
IN_FLIGHT_INTERVAL = 30.0
#: Batches (of ``celery_sched_batch_size`` rows) one pass moves at most, of
#: stranded rows and of a full pass each, so a large move never stalls
#: dispatching; a pass that hits it asks to run again at once.
REHOME_BATCHES = 10


def describe(moved: Sequence[Rehomed]) -> str:
    """``"3 from shard 2 to 0, 1 from shard 3 to 1"``: what a batch moved."""
    counts = Counter((move.from_shard, move.to_shard) for move in moved)
    return ", ".join(
        f"{count} from shard {source} to {target}"
        for (source, target), count in sorted(counts.items())
    )


@dataclasses.dataclass
class ReshardReport:
    """What a whole pass (:func:`reshard`) read and moved."""

    scanned: int = 0
    moved: int = 0
    batches: int = 0
    #: Rows moved (or, in a dry run, to move) per ``(from shard, to shard)``.
    by_shards: Counter[tuple[int, int]] = dataclasses.field(default_factory=Counter)

    def add(self, result: RehomeResult) -> None:
        self.scanned += result.scanned
        self.moved += len(result.moved)
        self.batches += 1
        self.by_shards.update((move.from_shard, move.to_shard) for move in result.moved)


def reshard(
    jobs: Jobs,
    *,
    shards: int,
    shard_of: Callable[[str], int],
    batch: int,
    dry_run: bool = False,
    on_batch: Callable[[RehomeResult], None] = lambda result: None,
) -> ReshardReport:
    """Move every unfinished row to the shard ``shard_of`` gives its key:
    stranded rows first (soonest due first), then a full pass in id order;
    then record ``shards`` as the count the rows are placed for. A batch
    per transaction; ``on_batch`` sees each. ``dry_run``: one full pass
    that counts what would move, moving and recording nothing."""
    report = ReshardReport()
    if not dry_run:
        while True:
            result = jobs.rehome(shards=shards, shard_of=shard_of, limit=batch, stranded_only=True)
            report.add(result)
            on_batch(result)
            if result.scanned < batch:
                break
    after: uuid.UUID | None = None
    while True:
        result = jobs.rehome(
            shards=shards,
            shard_of=shard_of,
            limit=batch,
            stranded_only=False,
            after=after,
            dry_run=dry_run,
        )
        report.add(result)
        on_batch(result)
        after = result.after
        if after is None:
            break
    if not dry_run:
        jobs.record_placement(shards)
    return report


class Rehoming:
    """Shard 0's leader's share: rows moved to their key's shard, a bounded
    number of batches per pass."""

    def __init__(
        self,
        *,
        store: Jobs,
        staging: Staging,
        settings: Settings,
        store_clock: StoreClock,
        stats: EngineStats,
        shard_of: Callable[[str], int],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._clock = clock
        #: When the next look at stranded jobs in flight is due (monotonic).
        self._next_in_flight = 0.0
        self._staging = staging
        self._settings = settings
        self._store_clock = store_clock
        self._stats = stats
        self._shard_of = shard_of
        self._shards = settings.shards
        self._batch = settings.batch_size
        #: Seconds between passes.
        self.interval = REHOME_INTERVAL
        # Where the full pass goes on from (None: its start), and whether
        # one is due (None: not known yet; read from the store).
        self._after: uuid.UUID | None = None
        self._full_pass_due: bool | None = None

    def elected(self) -> None:
        """Start over: another leader may have finished or begun a pass."""
        self._after = None
        self._full_pass_due = None
        self._next_in_flight = 0.0

    def run(self) -> bool:
        """One pass; True when work was left for the next one."""
        if self._settings.engine_shard != 0:
            return False
        more = self._stranded()
        if self._full_pass_due is None:
            placed = self._store.placed_for()
            self._full_pass_due = placed != self._shards
            if self._full_pass_due:
                logger.info(
                    "shard 0: the jobs were last placed for %s shards, now %d: "
                    "moving the misplaced ones",
                    "an unknown number of" if placed is None else placed,
                    self._shards,
                )
        if self._full_pass_due:
            if self._shards == 1:
                # Every key hashes to shard 0: the misplaced rows are exactly
                # the stranded ones, so no walk over every unfinished row.
                more = self._stranded(in_flight=True) or more
                if not more:
                    self._placed()
            else:
                more = self._full_pass() or more
        return more

    def _stranded(self, *, in_flight: bool | None = None) -> bool:
        """Move stranded jobs, a bounded number of batches; True if more are left.
        In flight ones too when ``in_flight``, or (None) when their look is due."""
        if in_flight is None:
            now = self._clock()
            in_flight = now >= self._next_in_flight
            if in_flight:
                self._next_in_flight = now + IN_FLIGHT_INTERVAL
        for _ in range(REHOME_BATCHES):
            result = self._store.rehome(
                shards=self._shards,
                shard_of=self._shard_of,
                limit=self._batch,
                stranded_only=True,
                in_flight=in_flight,
            )
            self._moved(result, f"stranded in shards >= {self._shards}")
            if result.scanned < self._batch:
                return False
        return True

    def _placed(self) -> None:
        self._store.record_placement(self._shards)
        self._full_pass_due = False
        logger.info("shard 0: every unfinished job is placed for %d shards", self._shards)

    def _full_pass(self) -> bool:
        for _ in range(REHOME_BATCHES):
            result = self._store.rehome(
                shards=self._shards,
                shard_of=self._shard_of,
                limit=self._batch,
                stranded_only=False,
                after=self._after,
            )
            self._moved(result, "placed for another shard count")
            self._after = result.after
            if result.after is None:
                self._placed()
                return False
        return True

    def _moved(self, result: RehomeResult, why: str) -> None:
        if not result.moved:
            return
        self._stats.rehomed += len(result.moved)
        logger.info("shard 0: moved %d jobs %s: %s", len(result.moved), why, describe(result.moved))
        self._stage(result.moved)

    def _stage(self, moved: Sequence[Rehomed]) -> None:
        """Stage the moved pending rows due within the window for their new
        shard, as its own stager would have had they been there all along."""
        horizon = self._store_clock.now() + dt.timedelta(seconds=self._settings.staging_window)
        by_shard: dict[int, list[tuple[uuid.UUID, dt.datetime]]] = {}
        for move in moved:
            if move.status is JobStatus.PENDING and move.due_at <= horizon:
                by_shard.setdefault(move.to_shard, []).append((move.id, move.due_at))
        try:
            for shard, items in by_shard.items():
                self._staging.add(shard, items)
        except StagingUnavailable as exc:
            # Their new shard's sweep claims them from Postgres.
            logger.warning("shard 0: moved jobs not staged (%s); the sweep will claim them", exc)
