"""The leader's counters: every duty adds to one :class:`EngineStats`.

Plain integers and lists, added to once per batch: the dispatch path never
calls into a metrics library. :mod:`celery_sched.metrics` reads them when
Prometheus scrapes.
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime as dt
import threading
from collections.abc import Sequence

#: Upper bounds (seconds) of the dispatch lag histogram's buckets: from a
#: job's due time to its publish.
LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
#: Upper bounds (seconds) of the claim histogram's buckets: one claim statement.
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_ZERO = dt.timedelta(0)


class BatchHistogram:
    """A histogram filled a batch at a time, read at scrape time.

    ``counts[i]`` counts the values ``<= bounds[i]`` and above the bound
    before it (not cumulative); the last slot counts those above every
    bound. Thread-safe: the sweep claims on helper threads.
    """

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        """Count one value."""
        slot = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[slot] += 1
            self._sum += value

    def observe_lags(self, now: dt.datetime, dues: list[dt.datetime]) -> None:
        """Count ``now - due`` for every ``due`` of a batch (sorted here, in place).

        Per batch, not per job: sorted due times (claims return them in due
        order already, which sorting finds in one pass) are split at each
        bucket's bound by bisection, so the work per job is the sort's
        comparison and one subtraction for the sum.
        """
        if not dues:
            return
        dues.sort()
        total = len(dues)
        # A lag <= bound means due >= now - bound: how many dues are at or
        # after that instant is the bucket's cumulative count.
        counts = []
        below = 0
        for bound in self.bounds:
            within = total - bisect.bisect_left(dues, now - dt.timedelta(seconds=bound))
            counts.append(within - below)
            below = within
        counts.append(total - below)
        lag = sum([now - due for due in dues], _ZERO).total_seconds()
        with self._lock:
            for slot, count in enumerate(counts):
                self._counts[slot] += count
            self._sum += lag

    def snapshot(self) -> tuple[list[int], float]:
        """``(counts per slot, sum)`` as they are now."""
        with self._lock:
            return list(self._counts), self._sum


@dataclasses.dataclass
class EngineStats:
    """Counters since start; read by ``info``, the CLI and metrics."""

    published: int = 0
    released: int = 0
    expired: int = 0
    requeued: int = 0
    dead: int = 0
    timed_out: int = 0
    #: Dispatched jobs no worker tracks, marked sent instead of requeued.
    untracked: int = 0
    staged: int = 0
    claims: int = 0
    elections: int = 0
    step_downs: int = 0
    errors: int = 0
    planned: int = 0
    pruned_jobs: int = 0
    pruned_ledger: int = 0
    #: Running jobs of worker processes that stopped beating (the rescuer);
    #: the requeued and dead among them are in ``requeued`` / ``dead`` too.
    rescued: int = 0
    #: Rescued jobs the idempotency ledger records as completed: succeeded.
    rescued_succeeded: int = 0
    pruned_workers: int = 0
    #: Jobs moved to the shard their key hashes to (a changed shard count).
    rehomed: int = 0
    #: Jobs whose own message could not be published (each counted an attempt).
    rejected: int = 0
    #: Late occurrences the misfire policy dropped at their first dispatch.
    missed: int = 0
    #: Jobs left dispatched because the lease ran out while publishing.
    withheld: int = 0
    #: Monotonic time of the last sign of life of the loop: a pass ended,
    #: or a batch went out (a long sweep through a backlog is one pass).
    progress_at: float = 0.0
    #: Failed duties by name (``stage``, ``pop``, ``sweep``, ...): ``errors`` split up.
    failures: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Jobs not published, by why: ``broker`` (unavailable; released),
    #: ``rejected`` (their own message), ``withheld`` (the lease ran out),
    #: ``error`` (the dispatcher raised; left dispatched).
    publish_failures: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Jobs put back to pending, by what did it: ``reconcile``, ``rescue``,
    #: ``publish_rejected``.
    requeued_by: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Publish time minus due time of every job sent (store clock).
    dispatch_lag: BatchHistogram = dataclasses.field(
        default_factory=lambda: BatchHistogram(LAG_BUCKETS)
    )
    #: Seconds per claim statement (staged ids or a sweep batch).
    claim_seconds: BatchHistogram = dataclasses.field(
        default_factory=lambda: BatchHistogram(CLAIM_BUCKETS)
    )

    def count(self, table: dict[str, int], reason: str, n: int) -> None:
        """Add ``n`` to ``table[reason]`` (``publish_failures``, ``requeued_by``)."""
        if n:
            table[reason] = table.get(reason, 0) + n
