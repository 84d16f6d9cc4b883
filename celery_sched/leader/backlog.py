"""The backlog: what the leader reads every few seconds for the gauges.

Every leader reads the size of its shard's staging set. The leader of shard
0 (which also plans and prunes) reads what belongs to no shard: the number of
jobs per status and the age of the backlog, i.e. how long ago the oldest due
``pending`` job of any shard was due (0 when none is). Nothing acts on these
values; :mod:`celery_sched.metrics` exports the last :class:`Backlog` read
while this process leads.

The age is one probe of the pending index per shard, cheap at any size. The
counts by status read the whole table, so they are read at most every
:data:`COUNTS_INTERVAL` seconds, and less often when the count is slow:
never more than ``1 / COUNTS_COST_FACTOR`` of the time. Each reading runs on
a thread of its own (one at a time, on a pooled connection), so a slow count
never holds up dispatching.

Failures: Redis being down leaves the staging size unknown (``None``), not a
failure. What a reading raised is raised by the next :meth:`BacklogReader.run`
on the loop's thread: the loop logs and counts a failed ``backlog``; the
values read before are kept.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from celery_sched.errors import StagingUnavailable
from celery_sched.models import JobStatus

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore, Staging
    from celery_sched.leader.clock import StoreClock
    from celery_sched.settings import Settings

#: Seconds between the leader's readings.
BACKLOG_INTERVAL = 5.0
#: Shortest time between two counts of the jobs by status, in seconds.
COUNTS_INTERVAL = 15.0
#: The counts wait at least this many times as long as the last count took.
COUNTS_COST_FACTOR = 20.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backlog:
    """One reading. ``None``: not read by this leader, or unavailable."""

    #: Jobs in this shard's staging set.
    staged: int | None = None
    #: Jobs per status, every status present (shard 0's leader only).
    jobs: dict[JobStatus, int] | None = None
    #: Seconds since the oldest due pending job was due, 0 when none is
    #: (shard 0's leader only, over every shard).
    oldest_due_seconds: float | None = None


class BacklogReader:
    """Reads one :class:`Backlog` per :attr:`interval` for the leader."""

    def __init__(
        self,
        *,
        store: JobStore,
        staging: Staging,
        settings: Settings,
        store_clock: StoreClock,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._staging = staging
        self._store_clock = store_clock
        self._clock = clock
        self._shard = settings.engine_shard
        self._shards = settings.shards
        self._next_counts = 0.0
        #: Seconds between readings.
        self.interval = BACKLOG_INTERVAL
        #: The last reading (empty until the first).
        self.last = Backlog()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="celery_sched-backlog")
        self._reading: Future[None] | None = None
        # Bumped by forget(): a reading started before does not count.
        self._generation = 0
        self._lock = threading.Lock()

    def forget(self) -> None:
        """Drop what was read (on stepping down: another leader reads now)."""
        with self._lock:
            self._generation += 1
            self.last = Backlog()
            self._next_counts = 0.0

    def run(self) -> None:
        """Start a reading into :attr:`last` unless one is still going; raise
        what the previous reading raised."""
        reading = self._reading
        if reading is not None:
            if not reading.done():
                return
            self._reading = None
            reading.result()
        self._reading = self._pool.submit(self._read, self._generation)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the reading in progress, if any (tests, shutdown)."""
        reading = self._reading
        if reading is not None:
            try:
                reading.result(timeout)
            except Exception:
                return

    def close(self) -> None:
        """Stop the reading thread (a reading in progress is let finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, generation: int) -> None:
        try:
            staged: int | None = self._staging.size(self._shard)
        except StagingUnavailable:
            staged = None
        if self._shard != 0:
            self._keep(generation, Backlog(staged=staged))
            return
        oldest = None
        for shard in range(self._shards):
            due = self._store.oldest_due_pending(shard=shard)
            if due is not None and (oldest is None or due < oldest):
                oldest = due
        age = 0.0
        if oldest is not None:
            age = max(0.0, (self._store_clock.now() - oldest) / dt.timedelta(seconds=1))
        jobs = self.last.jobs
        started = self._clock()
        if started >= self._next_counts:
            counts = self._store.counts_by_status()
            jobs = {status: counts.get(status, 0) for status in JobStatus}
            took = self._clock() - started
            with self._lock:
                if generation == self._generation:
                    self._next_counts = started + max(COUNTS_INTERVAL, COUNTS_COST_FACTOR * took)
        self._keep(generation, Backlog(staged=staged, jobs=jobs, oldest_due_seconds=age))

    def _keep(self, generation: int, backlog: Backlog) -> None:
        with self._lock:
            if generation == self._generation:
                self.last = backlog
