"""Publishing a claimed batch, and settling what did not go out.

Used by the claimer (staged ids) and the sweeper (rows claimed straight from
Postgres); both claim before they publish, so a crash after the claim leaves
the rows ``dispatched`` for the reconciler, never lost.

What happens to a batch's jobs:

- late occurrences the misfire policy drops: ``missed``, never sent
  (:mod:`celery_sched.leader.misfire`);
- sent: stay ``dispatched`` until a worker reports them;
- expired before they were due: ``expired``, with the reason;
- rejected (unroutable, unencodable, their queue refused): each fails alone,
  ``attempt + 1`` with the reason, ``dead`` past ``max_attempts``; the rest
  of the batch goes out;
- not sent because the broker is down: released to ``pending`` (fenced),
  then :class:`~celery_sched.errors.PublishError` is raised so the loop
  backs off;
- withheld because the lease ran out mid-batch: released to ``pending``
  (fenced by the claim's epoch and the row still being ``dispatched``, so a
  stale leader's release touches only what it claimed and nobody took
  since).

Once every job not sent has left ``dispatched``, the batch's claim is
recorded as published (:meth:`~celery_sched.interfaces.Jobs.record_published`).
The reconciler marks a dispatched job that no worker tracks ``sent`` only
when its claim was recorded; it requeues any other, so a job claimed by a
beat that died before publishing is sent again instead of ending ``sent``.

Failures: should a settling write fail, the rows stay ``dispatched``, the
claim is not recorded and the reconciler requeues them (logged at WARNING,
never raised). Should the dispatcher itself raise, that propagates to the
duty that published, the claim unrecorded.
"""

from __future__ import annotations

import logging
import operator
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from celery_sched.errors import PublishError, StoreError
from celery_sched.models import DueSpan

if TYPE_CHECKING:
    from celery_sched.interfaces import Dispatcher, JobStore
    from celery_sched.leader.clock import StoreClock
    from celery_sched.leader.misfire import LateOccurrences
    from celery_sched.leader.stats import EngineStats
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.models import Job

logger = logging.getLogger(__name__)

_due_at = operator.attrgetter("due_at")
_claim_id = operator.attrgetter("claim_id")


class Publisher:
    """Publishes claimed jobs for one shard and records each job's outcome."""

    def __init__(
        self,
        *,
        store: JobStore,
        dispatcher: Dispatcher,
        elector: LeaderElector,
        store_clock: StoreClock,
        stats: EngineStats,
        shard: int,
        late: LateOccurrences,
    ) -> None:
        self._store = store
        self._dispatcher = dispatcher
        self._elector = elector
        self._store_clock = store_clock
        self._stats = stats
        self._shard = shard
        self._late = late

    def holds(self, epoch: int) -> bool:
        """Whether the lease of ``epoch`` is still locally valid (no I/O)."""
        lease = self._elector.current()
        return lease is not None and lease.epoch == epoch

    def publish(self, jobs: Sequence[Job], epoch: int) -> None:
        """Publish ``jobs`` (claimed under ``epoch``) and settle the rest.

        Raises :class:`~celery_sched.errors.PublishError` once the jobs the
        broker could not take are released.
        """
        if not jobs:
            return
        self._stats.claims += 1
        now = self._store_clock.now()
        # Where the batch's rows are: every settling write names its jobs by
        # id within these due times (one partition, mostly).
        claimed = jobs
        claimed_dues = list(map(_due_at, jobs))
        due = DueSpan.of(claimed_dues)
        jobs = self._late.drop_missed(jobs, epoch, now)
        # A leader paused between claim and publish for longer than its
        # lease must not publish: a successor may have requeued and sent
        # these jobs already. Checked before every chunk.
        stats = self._stats
        try:
            result = self._dispatcher.publish(
                jobs, epoch=epoch, now=now, may_publish=lambda: self.holds(epoch)
            )
        except Exception:
            # Which jobs went out is unknown: they stay dispatched, and the
            # reconciler requeues them with an attempt counted, so a batch
            # that always breaks the dispatcher ends dead instead of being
            # claimed again at once, forever.
            stats.count(stats.publish_failures, "error", len(jobs))
            raise
        sent = result.sent
        stats.published += len(sent)
        if sent:
            # Once per batch: when the batch's publish returned, by the
            # store's clock.
            if len(sent) == len(jobs):
                dues = claimed_dues if jobs is claimed else list(map(_due_at, jobs))
            else:
                ids = set(sent)
                dues = [job.due_at for job in jobs if job.id in ids]
            stats.dispatch_lag.observe_lags(self._store_clock.now(), dues)
            stats.progress_at = self._store_clock.monotonic()
        # Every job not sent leaves ``dispatched`` here, even once the lease
        # is gone: each write is fenced by the claim's epoch and by the row
        # still being dispatched, so it can only touch rows this term
        # claimed and nobody has requeued or claimed since.
        settled = True
        if result.withheld:
            stats.withheld += len(result.withheld)
            stats.count(stats.publish_failures, "withheld", len(result.withheld))
            logger.warning(
                "shard %d: the lease of epoch %d ran out while publishing; releasing the %d "
                "jobs not sent",
                self._shard,
                epoch,
                len(result.withheld),
            )
            settled &= self.settle("release", result.withheld, epoch, due=due)
        if result.expired:
            settled &= self.settle("expire", result.expired, epoch, due=due)
        if result.rejected:
            stats.count(stats.publish_failures, "rejected", len(result.rejected))
            settled &= self._fail(result.rejected, epoch, due)
        if result.failed:
            stats.count(stats.publish_failures, "broker", len(result.failed))
            logger.warning("%d jobs failed to publish; releasing them", len(result.failed))
            settled &= self.settle("release", result.failed, epoch, due=due)
        if sent and settled:
            # The claim's jobs still dispatched are exactly the ones sent.
            # Unrecorded (a settling write failed, the process dies first),
            # the reconciler requeues them all: a second run at worst.
            self._record_published(jobs)
        if result.failed:
            # The broker is down: back off (step() does) instead of claiming
            # the same jobs again at once.
            raise PublishError(f"broker unavailable: {len(result.failed)} jobs not published")

    def _record_published(self, jobs: Sequence[Job]) -> None:
        claims = set(map(_claim_id, jobs))
        claims.discard(None)
        try:
            self._store.record_published(sorted(claims), shard=self._shard)
        except StoreError as exc:
            logger.warning(
                "shard %d: could not record %d published jobs (%s); the reconciler will "
                "send them again",
                self._shard,
                len(jobs),
                exc,
            )

    def settle(
        self,
        action: Literal["release", "expire"],
        job_ids: Sequence[uuid.UUID],
        epoch: int,
        *,
        due: DueSpan,
    ) -> bool:
        """Finish a transition after publishing (of jobs due within ``due``);
        on failure (False) the reconciler will."""
        try:
            if action == "release":
                self._stats.released += self._store.release(job_ids, epoch=epoch, due=due)
            else:
                self._stats.expired += self._store.mark_expired(
                    job_ids, epoch=epoch, reason="expired before it was due", due=due
                )
        except StoreError as exc:
            logger.warning(
                "could not %s %d jobs (%s); the reconciler will requeue them",
                action,
                len(job_ids),
                exc,
            )
            return False
        return True

    def _fail(self, rejected: dict[uuid.UUID, str], epoch: int, due: DueSpan) -> bool:
        """Count a failed publish against each job (dead past max_attempts);
        False when that could not be written (the reconciler will)."""
        try:
            result = self._store.fail_dispatch(list(rejected.items()), epoch=epoch, due=due)
        except StoreError as exc:
            logger.warning(
                "could not record %d failed publishes (%s); the reconciler will requeue them",
                len(rejected),
                exc,
            )
            return False
        self._stats.rejected += result.requeued + result.dead
        self._stats.dead += result.dead
        self._stats.count(self._stats.requeued_by, "publish_rejected", result.requeued)
        logger.warning(
            "shard %d: %d jobs could not be published (%d requeued with an attempt counted, "
            "%d dead); first: %s",
            self._shard,
            len(rejected),
            result.requeued,
            result.dead,
            next(iter(rejected.values())),
        )
        return True
