"""The reconciler: requeuing jobs that were dispatched but never started.

A job stays ``dispatched`` when its message was lost (the broker restarted
empty, a leader died between claim and publish, its lease ran out mid-batch)
and ``retrying`` when its retry message was lost. Once longer ago than its
visibility timeout, the reconciler puts it back to ``pending`` with
``attempt + 1`` (``dead`` past ``max_attempts``, with the reason), and the
leader dispatches it again. Jobs running past their ``max_runtime`` go the
same way. Every move is fenced by the leader's epoch.

The leader runs one batch every ``celery_sched_reconcile_interval`` seconds
(:meth:`Reconciler.run`); ``celery -A proj sched reconcile`` runs batches
until one comes back short (:meth:`Reconciler.drain`).

Failures: whatever the store raises propagates. In the loop, a failed
``reconcile`` is logged and counted and retried at the next interval, and
:class:`~celery_sched.errors.StaleEpoch` makes the leader step down; nothing
is moved by a batch that failed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore
    from celery_sched.leader.stats import EngineStats
    from celery_sched.models import ReconcileResult
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Jobs the reconciler (and the rescuer) move per transaction, in dispatch
#: batches: this many times ``celery_sched_batch_size``.
REQUEUE_BATCHES = 10


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
        #: Jobs moved per transaction at most.
        self.limit = limit or requeue_limit(settings)

    def run(self, epoch: int) -> None:
        """The leader's duty: one batch, logged at WARNING if it moved anything."""
        result = self._batch(epoch)
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
            result = self._batch(epoch)
            if result.requeued + result.dead + result.untracked < self.limit:
                return

    def _batch(self, epoch: int) -> ReconcileResult:
        result = self._store.reconcile(
            shard=self.shard,
            epoch=epoch,
            limit=self.limit,
            default_visibility_timeout=self._visibility_timeout,
        )
        self._stats.requeued += result.requeued
        self._stats.count(self._stats.requeued_by, "reconcile", result.requeued)
        self._stats.dead += result.dead
        self._stats.timed_out += result.timed_out
        self._stats.untracked += result.untracked
        return result
