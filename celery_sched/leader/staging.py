"""Staging: copying jobs due soon from Postgres into Redis, incrementally.

The claimer pops staged ids the moment they are due, so a job is published
on time without Postgres being polled for it. Each pass reads only what
entered the window (``celery_sched_staging_window``) since the last one, up
to a high-water mark; only the future is staged, anything already due
belongs to the sweep.

Failures: Redis being down only slows things. The high-water mark stays
where it was (the next pass retries), a warning is logged, and the sweep is
brought forward to claim straight from Postgres; the duty does not count as
failed. A store error propagates: the loop logs it, counts a failed
``stage`` and retries after its backoff (the mark is then not moved either).
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from celery_sched.errors import StagingUnavailable

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore, Staging
    from celery_sched.leader.clock import StoreClock
    from celery_sched.leader.stats import EngineStats
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Most ids one staging pass reads, in batches of ``celery_sched_batch_size``
#: (and at least :data:`STAGE_LIMIT_MIN`).
STAGE_BATCHES = 50
#: The fewest ids one staging pass may read.
STAGE_LIMIT_MIN = 10_000


class Stager:
    """Keeps one shard's staging set filled with the jobs due within the window.

    ``sweep_by(deadline)``: asks the loop to sweep Postgres no later than the
    monotonic ``deadline`` (``0.0``: in this pass), for when Redis is down.
    """

    def __init__(
        self,
        *,
        store: JobStore,
        staging: Staging,
        settings: Settings,
        store_clock: StoreClock,
        stats: EngineStats,
        sweep_by: Callable[[float], None],
    ) -> None:
        self._store = store
        self._staging = staging
        self._store_clock = store_clock
        self._stats = stats
        self._sweep_by = sweep_by
        self._shard = settings.engine_shard
        self._window = settings.staging_window
        #: Seconds between passes. Frequent small increments: each pass reads
        #: and stages only what entered the window since the last one, so no
        #: pass stalls the loop.
        self.interval = max(0.25, min(settings.staging_window / 4, 1.0))
        #: Most ids one pass reads; a pass that hits it goes on from the last one.
        self.limit = max(settings.batch_size * STAGE_BATCHES, STAGE_LIMIT_MIN)
        # Due time up to which every pending job is staged (None: unknown,
        # start over from the store's present).
        self._staged_until: dt.datetime | None = None
        # Beats before hash tags may still lead (and pop the old staging
        # set) while the lease holds their key too; only once it does not
        # is the old set retired, at the first pass of each term.
        self._retire_legacy = not settings.hold_legacy_lease_keys
        self._legacy_pending = False

    def elected(self) -> None:
        """A new term: start over from the present, and retire the staging
        set of clients before hash tags at the next pass (once no old beat
        runs: ``celery_sched_legacy_lease_keys`` off, or a Cluster)."""
        self.rewind()
        self._legacy_pending = self._retire_legacy

    def rewind(self) -> None:
        """Forget the high-water mark: the next pass starts from the present
        (after an election, a step-down, or a staging set that may be lost)."""
        self._staged_until = None

    def stage(self) -> None:
        """Copy jobs due within the window into Redis, incrementally."""
        if self._legacy_pending and not self._drop_legacy():
            return
        store_now = self._store_clock.measure()
        horizon = store_now + dt.timedelta(seconds=self._window)
        limit = self.limit
        # Only the future is staged: anything already due belongs to the
        # sweep, which claims it from Postgres in bulk.
        items = self._store.due_soon(
            shard=self._shard,
            within=self._window,
            limit=limit,
            after=self._staged_until or store_now,
        )
        try:
            if items:
                self._stats.staged += self._staging.add(self._shard, items)
        except StagingUnavailable as exc:
            # Keep the high-water mark where it was: the next pass retries,
            # and meanwhile the sweep claims straight from Postgres.
            self.unavailable(exc, sweep_by=0.0)
            return
        self._staged_until = items[-1][1] if len(items) >= limit else horizon

    def _drop_legacy(self) -> bool:
        """Retire the legacy staging set; False when Redis refused."""
        try:
            moved = self._staging.drop_legacy(self._shard)
        except StagingUnavailable as exc:
            self.unavailable(exc, sweep_by=0.0)
            return False
        self._legacy_pending = False
        if moved:
            logger.info(
                "shard %d: staged %d ids from the staging set of clients before hash "
                "tags, and emptied it",
                self._shard,
                moved,
            )
        return True

    def stage_planned(self, written: Sequence[tuple[uuid.UUID, dt.datetime, int]]) -> None:
        """Stage new occurrences due within the window: the stager only reads
        what lies beyond its high-water mark, and may have passed these."""
        horizon = self._store_clock.now() + dt.timedelta(seconds=self._window)
        items = [(job_id, due) for job_id, due, shard in written if shard == self._shard]
        items = [(job_id, due) for job_id, due in items if due <= horizon]
        if not items:
            return
        try:
            self._stats.staged += self._staging.add(self._shard, items)
        except StagingUnavailable as exc:
            self.unavailable(exc, sweep_by=0.0)

    def unavailable(
        self, exc: StagingUnavailable, *, sweep_by: float, rewind: bool = False
    ) -> None:
        """Redis refused a staging call: sweep Postgres by ``sweep_by``
        instead; ``rewind`` when staged ids may have been lost with it."""
        logger.warning("staging unavailable (%s); sweeping from Postgres", exc)
        self._sweep_by(sweep_by)
        if rewind:
            # The high-water mark may cover ids a FLUSHALL or restart lost.
            self.rewind()
