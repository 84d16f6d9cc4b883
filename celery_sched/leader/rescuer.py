"""The rescuer: finishing the running jobs of worker processes that died.

A worker process that dies mid-task (``kill -9``, OOM, a lost host) leaves
its job ``running`` for ever: no report will come. Workers beat a heartbeat
row per process; once a process has been silent for
``celery_sched_worker_timeout`` seconds, its running jobs are rescued:
``succeeded`` when the idempotency ledger records the job as completed,
otherwise requeued (``attempt + 1``, ``dead`` past ``max_attempts``, the
reason naming the host, pid and last heartbeat). Jobs of workers that do not
beat are left alone. Every move is fenced by the leader's epoch.

Failures: whatever the store raises propagates. The loop logs and counts a
failed ``rescue`` and tries again at the next interval;
:class:`~celery_sched.errors.StaleEpoch` makes the leader step down.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery_sched.leader.reconciler import requeue_limit

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore
    from celery_sched.leader.stats import EngineStats
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Longest time between rescuer passes, in seconds (a quarter of
#: ``celery_sched_worker_timeout`` when that is shorter).
RESCUE_INTERVAL = 15.0


class Rescuer:
    """Rescues one shard's running jobs whose worker process stopped beating."""

    def __init__(self, store: JobStore, settings: Settings, stats: EngineStats) -> None:
        self._store = store
        self._stats = stats
        self._shard = settings.engine_shard
        self._worker_timeout = settings.worker_timeout
        #: Seconds between passes.
        self.interval = max(0.1, min(RESCUE_INTERVAL, settings.worker_timeout / 4))
        #: Jobs rescued per pass at most (one statement).
        self.limit = requeue_limit(settings)

    def run(self, epoch: int) -> None:
        """Requeue (or, by the ledger, finish) running jobs of dead worker processes."""
        result = self._store.rescue(
            shard=self._shard,
            epoch=epoch,
            limit=self.limit,
            worker_timeout=self._worker_timeout,
        )
        self._stats.requeued += result.requeued
        self._stats.count(self._stats.requeued_by, "rescue", result.requeued)
        self._stats.dead += result.dead
        self._stats.rescued += result.rescued
        self._stats.rescued_succeeded += result.succeeded
        if result.rescued:
            logger.warning(
                "rescuer: %d running jobs of stopped workers: requeued %d, dead %d, "
                "succeeded by the ledger %d",
                result.rescued,
                result.requeued,
                result.dead,
                result.succeeded,
            )
