"""The reconciler: requeuing jobs that were dispatched but never started.

A job stays ``dispatched`` when its message was lost (the broker restarted
empty, a leader died between claim and publish, its lease ran out mid-batch)
and ``retrying`` when its retry message was lost. Once longer ago than its
visibility timeout, the reconciler puts it back to ``pending`` with
``attempt + 1`` (``dead`` past ``max_attempts``, with the reason), and the
leader dispatches it again. Jobs running past their ``max_runtime`` go the
same way. Every move is fenced by the leader's epoch.

The leader runs one pass every ``celery_sched_reconcile_interval`` seconds,
of ``limit`` rows at most (:meth:`Reconciler.run`), in slices of
:data:`SLICE` rows: one slice per loop pass, the next right after
dispatching, so that a pass with many stale jobs never holds claims back
for long (the loop is single-threaded). ``celery -A proj sched reconcile``
runs batches of ``limit`` until one comes back short
(:meth:`Reconciler.drain`).

Measured (issue #31, ``benchmarks/reconcile.py``): a transaction costs
about 3.5 ms when it finds nothing stale (four statements, the fence, with
300,000 jobs in flight: 214 ms before migration 0015) and about 17 us per
requeued row, so a pass of 10,000 stale rows in one transaction stalled the
loop 170 ms; a slice of 200 stays under 10 ms. Slices are fenced each, as
the passes were; the rows per interval (the reconciler's pace) are the same.

Failures: whatever the store raises propagates. In the loop, a failed
``reconcile`` is logged and counted and retried at the next interval, and
:class:`~celery_sched.errors.StaleEpoch` makes the leader step down; nothing
is moved by a batch that failed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from celery_sched.models import ReconcileResult

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore
    from celery_sched.leader.stats import EngineStats
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Jobs the reconciler (and the rescuer) move per transaction, in dispatch
#: batches: this many times ``celery_sched_batch_size``.
REQUEUE_BATCHES = 10
#: Jobs the leader's reconciler moves per transaction (per loop pass); a
#: pass goes on in slices of this many up to ``limit``.
SLICE = 200


def requeue_limit(settings: Settings) -> int:
    """Jobs one reconciler or rescuer transaction moves at most."""
    return settings.batch_size * REQUEUE_BATCHES


class Reconciler:
    """Requeues one shard's dispatched jobs that no worker started in time.

    ``shard`` defaults to ``settings.engine_shard``, ``limit`` (rows per
    transaction) to :func:`requeue_limit`. What moved is added to ``stats``.
    """

    def __init__(
        self,
        store: JobStore,
        settings: Settings,
        stats: EngineStats,
        *,
        shard: int | None = None,
        limit: int | None = None,
    ) -> None:
        self._store = store
        self._stats = stats
        self._visibility_timeout = settings.visibility_timeout
        self.shard = settings.engine_shard if shard is None else shard
        #: Seconds between the leader's batches.
        self.interval = settings.reconcile_interval
        #: Jobs moved per pass (per transaction of :meth:`drain`) at most.
        self.limit = limit or requeue_limit(settings)
        #: Jobs moved per transaction of :meth:`run`.
        self.slice = min(SLICE, self.limit)
        # What the pass under way moved so far (None: no pass under way).
        self._pass: ReconcileResult | None = None

    def run(self, epoch: int) -> bool:
        """The leader's duty: one slice of the pass, logged at WARNING (once
        the pass is over) if it moved anything. True when the pass goes on:
        the slice came back full and the pass moved fewer than ``limit``."""
        so_far = self._pass or ReconcileResult()
        self._pass = None  # (a slice that raises ends the pass)
        moved_so_far = _moved(so_far)
        result = self._batch(epoch, min(self.slice, self.limit - moved_so_far))
        total = _plus(so_far, result)
        if _moved(result) >= self.slice and _moved(total) < self.limit:
            self._pass = total
            return True
        self._report(total)
        return False

    def _report(self, result: ReconcileResult) -> None:
        if result.requeued or result.dead or result.timed_out:
            logger.warning(
                "reconciler: requeued %d, dead %d, over max_runtime %d",
                result.requeued,
                result.dead,
                result.timed_out,
            )
        if result.untracked:
            logger.info(
                "reconciler: %d job(s) no worker tracks marked sent (not sent again)",
                result.untracked,
            )

    def drain(self, epoch: int) -> None:
        """Run batches until one moves fewer than :attr:`limit` jobs.

        Raises :class:`~celery_sched.errors.StaleEpoch` when a new leader
        took over meanwhile; ``stats`` then holds what the batches before
        it moved.
        """
        while True:
            result = self._batch(epoch, self.limit)
            if _moved(result) < self.limit:
                return

    def _batch(self, epoch: int, limit: int) -> ReconcileResult:
        result = self._store.reconcile(
            shard=self.shard,
            epoch=epoch,
            limit=limit,
            default_visibility_timeout=self._visibility_timeout,
        )
        self._stats.requeued += result.requeued
        self._stats.count(self._stats.requeued_by, "reconcile", result.requeued)
        self._stats.dead += result.dead
        self._stats.timed_out += result.timed_out
        self._stats.untracked += result.untracked
        return result


def _moved(result: ReconcileResult) -> int:
    """Rows a reconcile moved (those timed out are among the requeued and dead)."""
    return result.requeued + result.dead + result.untracked


def _plus(a: ReconcileResult, b: ReconcileResult) -> ReconcileResult:
    return ReconcileResult(
        **{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)}
    )
