"""Sweeping: claiming due rows straight from Postgres (the fallback path).

The sweep catches what staging missed: jobs scheduled already due, a Redis
outage or wipe, a requeued job, a backlog. It claims the oldest due pending
rows in batches (fenced by the leader's epoch; ``SKIP LOCKED`` keeps
concurrent claims apart) and publishes each batch, every
``celery_sched_sweep_interval`` seconds, or at once while a backlog lasts.

Failures: a store or broker error ends the sweep; the loop logs and counts
a failed ``sweep`` and backs off. Batches claimed ahead and not yet
published are released to ``pending``, even once the lease is gone (or, if
that fails too, left ``dispatched`` for the reconciler); what the failed
batch did is said in
:mod:`celery_sched.leader.publishing`.
"""

from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from celery_sched.models import DueSpan

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore
    from celery_sched.leader.claiming import Claimer
    from celery_sched.leader.publishing import Publisher
    from celery_sched.leader.stats import EngineStats
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.models import Job
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: While the sweep drains a backlog, staged ids are served every this many batches.
STAGED_EVERY = 4
#: Batches the sweep keeps being claimed, each on its own pooled connection,
#: while it publishes one. With one claim at a time the beat waited on each
#: claim's execution, commit and row transfer: three in flight took dispatch
#: from about 20k to 25-27k jobs/s on a 2-core machine (benchmarks/dispatch.py;
#: four did no better). SKIP LOCKED gives concurrent claims disjoint rows, each
#: the oldest left. Bounded by the pool: one connection always stays free.
CLAIMS_AHEAD = 3


class Sweeper:
    """Claims and publishes one shard's due pending rows from Postgres.

    Owns the threads that claim ahead: :meth:`close` stops them.
    """

    def __init__(
        self,
        *,
        store: JobStore,
        elector: LeaderElector,
        settings: Settings,
        publisher: Publisher,
        claimer: Claimer,
        stats: EngineStats,
    ) -> None:
        self._store = store
        self._elector = elector
        self._publisher = publisher
        self._claimer = claimer
        self._claim_seconds = stats.claim_seconds
        self._shard = settings.engine_shard
        #: Seconds between sweeps while there is no backlog.
        self.interval = settings.sweep_interval
        #: Rows claimed per batch.
        self.batch_size = settings.batch_size
        #: Claims in flight at most; one pooled connection stays free for the
        #: loop's own statements.
        self.claims_ahead = max(1, min(CLAIMS_AHEAD, settings.pool_max_size - 1))
        self._pool = ThreadPoolExecutor(
            max_workers=self.claims_ahead, thread_name_prefix="celery_sched-claim"
        )

    def close(self) -> None:
        """Wait for the claims in flight and stop their threads."""
        self._pool.shutdown(wait=True)

    def sweep(self, epoch: int) -> int:
        """Claim due pending rows and publish them; return how many were claimed.

        Through a backlog, the next batches (up to :data:`CLAIMS_AHEAD`) are
        claimed on helper threads while this one is published, so Postgres
        and the broker work at the same time instead of taking turns. Every
        claim is fenced by ``epoch`` on its own; batches claimed ahead when
        the pass fails are released.
        """
        if not self._elector.is_leader():
            return 0
        total = 0
        batches = 0
        batch = self.batch_size
        ahead: collections.deque[Future[list[Job]]] = collections.deque(
            [self._pool.submit(self._claim_batch, epoch)]
        )
        try:
            while ahead:
                jobs = ahead.popleft().result()
                if len(jobs) >= batch and self._elector.is_leader():
                    # A full batch: there is likely more; keep claims going.
                    while len(ahead) < self.claims_ahead:
                        ahead.append(self._pool.submit(self._claim_batch, epoch))
                if not jobs:
                    continue  # drain the claims still in flight
                self._publisher.publish(jobs, epoch)
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
                    self._claimer.pop_and_publish(epoch, drop_through=swept)
        finally:
            for claim in ahead:
                self._release_claimed_ahead(claim, epoch)
        if total:
            logger.info("sweep claimed %d due jobs from Postgres", total)
        return total

    def _claim_batch(self, epoch: int) -> list[Job]:
        if not self._publisher.holds(epoch):
            # The lease ran out since this claim was queued: whatever it
            # claimed would be withheld and released again.
            return []
        started = time.perf_counter()
        jobs = self._store.claim_due(shard=self._shard, epoch=epoch, limit=self.batch_size)
        self._claim_seconds.observe(time.perf_counter() - started)
        return jobs

    def _release_claimed_ahead(self, ahead: Future[list[Job]], epoch: int) -> None:
        # The pass failed (or the lease ran out) while a batch was being
        # claimed ahead: hand those jobs back, lease or not (the release is
        # fenced by the claim's epoch and the rows' status), or, if that
        # fails too, leave them to the reconciler, which requeues a claim
        # never recorded as published.
        try:
            jobs = ahead.result()
        except Exception:
            return
        if jobs:
            due = DueSpan.of(job.due_at for job in jobs)
            self._publisher.settle("release", [job.id for job in jobs], epoch, due=due)
