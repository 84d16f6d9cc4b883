"""Claiming staged jobs: the fast path that publishes a job when it is due.

Each pass pops the staged ids that are due from Redis, claims them in
Postgres (fenced by the leader's epoch; ids no longer pending or not yet due
by the store's clock are skipped) and publishes them. A full batch means
more may be due, so the loop goes round again without sleeping.

Failures: Redis being down is not a failure of the duty: a warning is
logged, the high-water mark of the stager is forgotten (the staged ids may
be gone) and the sweep claims from Postgres within ``celery_sched_max_tick``.
A store or broker error propagates: the loop logs and counts a failed
``pop`` and backs off; jobs already claimed stay ``dispatched`` for the
reconciler, or are released (see :mod:`celery_sched.leader.publishing`).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from celery_sched.errors import StagingUnavailable

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore, Staging
    from celery_sched.leader.clock import StoreClock
    from celery_sched.leader.publishing import Publisher
    from celery_sched.leader.staging import Stager
    from celery_sched.leader.stats import EngineStats
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.settings import Settings


class Claimer:
    """Claims and publishes one shard's staged ids once they are due."""

    def __init__(
        self,
        *,
        store: JobStore,
        staging: Staging,
        elector: LeaderElector,
        settings: Settings,
        store_clock: StoreClock,
        stager: Stager,
        publisher: Publisher,
        clock: Callable[[], float],
        stats: EngineStats,
    ) -> None:
        self._store = store
        self._staging = staging
        self._elector = elector
        self._store_clock = store_clock
        self._stager = stager
        self._publisher = publisher
        self._clock = clock
        self._claim_seconds = stats.claim_seconds
        self._shard = settings.engine_shard
        self._max_tick = settings.max_tick
        #: Most ids popped and claimed per pass.
        self.batch_size = settings.batch_size

    def pop_and_publish(self, epoch: int, drop_through: dt.datetime | None = None) -> bool:
        """Claim and publish staged ids that are due; True if more may be due.

        ``drop_through``: staged ids due by then are discarded unread (the
        sweeper passes the latest due time it has claimed through).
        """
        if not self._elector.is_leader():
            return False
        try:
            ids = self._staging.pop_due(
                self._shard, self._store_clock.now(), self.batch_size, drop_through=drop_through
            )
        except StagingUnavailable as exc:
            self._stager.unavailable(exc, sweep_by=self._clock() + self._max_tick, rewind=True)
            return False
        if not ids:
            return False
        started = time.perf_counter()
        jobs = self._store.claim_ids(ids, shard=self._shard, epoch=epoch)
        self._claim_seconds.observe(time.perf_counter() - started)
        self._publisher.publish(jobs, epoch)
        return len(ids) >= self.batch_size
