"""Housekeeping: the storage's upkeep (the days ahead's partitions), pruning
finished jobs, completed ledger entries and old heartbeats.

One bounded batch of each per interval, so a large backlog (after a long
stop, or a retention just lowered) is worked off gradually and never stalls
dispatching. The tables are shared by every shard, so only shard 0's leader
prunes. ``celery -A proj sched prune`` prunes everything at once instead.

Failures: a store or ledger error (:class:`~celery_sched.errors.CelerySchedError`)
is logged at WARNING and swallowed: pruning is not worth a step-down, and
the next interval tries again. Anything else propagates, and the loop logs
and counts a failed ``prune``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery_sched.errors import CelerySchedError

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore, Ledger
    from celery_sched.leader.stats import EngineStats
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Seconds between pruning rounds (one bounded batch per table each).
HOUSEKEEPING_INTERVAL = 30.0
#: Heartbeat rows are pruned once not seen for this long (or ten worker
#: timeouts, if longer): by then the rescuer has long acted on their jobs.
WORKER_RETENTION = 86400.0


class Housekeeper:
    """Prunes what outlived its retention, a bounded batch per table per round."""

    def __init__(
        self, store: JobStore, settings: Settings, stats: EngineStats, ledger: Ledger | None
    ) -> None:
        self._store = store
        self._settings = settings
        self._stats = stats
        self._ledger = ledger
        #: Seconds between rounds.
        self.interval = HOUSEKEEPING_INTERVAL

    def run(self) -> None:
        """Prune finished jobs and completed ledger entries past their retention,
        and heartbeat rows long silent."""
        settings = self._settings
        if settings.engine_shard != 0:
            return
        try:
            self._store.prepare_storage()
            if settings.retention > 0:
                self._stats.pruned_jobs += self._store.prune(
                    older_than=settings.retention, batch=settings.prune_batch, max_batches=1
                )
            if self._ledger is not None and settings.ledger_retention > 0:
                self._stats.pruned_ledger += self._ledger.prune(
                    older_than=settings.ledger_retention,
                    batch=settings.prune_batch,
                    max_batches=1,
                )
            self._stats.pruned_workers += self._store.prune_workers(
                older_than=max(WORKER_RETENTION, 10 * settings.worker_timeout)
            )
        except CelerySchedError as exc:
            logger.warning(
                "shard %d: pruning failed, will try again: %s", settings.engine_shard, exc
            )
