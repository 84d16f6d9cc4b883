"""An in-memory lease backend, leader board and beat membership for unit tests.

Same semantics as :class:`~celery_sched.lease.redis.RedisLeaseBackend`
(it passes the same contract tests), with expiry judged by an injected clock
so tests can move time instead of sleeping. Thread-safe: the elector's
background thread and the test thread may use it at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from celery_sched.errors import LeaseUnavailable
from celery_sched.interfaces import LeaderBoard, LeaseBackend, Membership
from celery_sched.lease.elector import token_holder
from celery_sched.models import LeaderReport, LeaderView


def _check_ttl(ttl: float) -> None:
    if ttl <= 0:
        raise ValueError(f"lease ttl must be positive, got {ttl!r}")


class MemoryLeaseBackend(LeaseBackend):
    """Leases in a dict: ``shard -> (token, expires_at)`` on ``clock``'s scale.

    Set :attr:`available` to ``False`` to simulate a Redis outage: every
    operation then raises :class:`~celery_sched.errors.LeaseUnavailable`.
    Leases keep expiring meanwhile, as they would in a Redis the caller
    cannot reach.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[int, tuple[str, float]] = {}
        self.available = True

    def acquire(self, shard: int, token: str, ttl: float) -> bool:
        _check_ttl(ttl)
        with self._lock:
            now = self._reachable_now()
            if self._live(shard, now) is not None:
                return False
            self._leases[shard] = (token, now + ttl)
            return True

    def renew(self, shard: int, token: str, ttl: float) -> bool:
        _check_ttl(ttl)
        with self._lock:
            now = self._reachable_now()
            if self._live(shard, now) != token:
                return False
            self._leases[shard] = (token, now + ttl)
            return True

    def release(self, shard: int, token: str) -> bool:
        with self._lock:
            now = self._reachable_now()
            if self._live(shard, now) != token:
                return False
            del self._leases[shard]
            return True

    def holder(self, shard: int) -> str | None:
        with self._lock:
            return self._live(shard, self._reachable_now())

    def _reachable_now(self) -> float:
        if not self.available:
            raise LeaseUnavailable("the lease backend (memory) is marked unavailable")
        return self._clock()

    def _live(self, shard: int, now: float) -> str | None:
        """The token holding ``shard`` at ``now``; drops an expired entry."""
        entry = self._leases.get(shard)
        if entry is None:
            return None
        token, expires_at = entry
        # Like Redis PX: the key is gone once its expiry instant is reached.
        if now >= expires_at:
            del self._leases[shard]
            return None
        return token


class MemoryLeaderBoard(LeaderBoard):
    """:class:`~celery_sched.interfaces.LeaderBoard` over a
    :class:`MemoryLeaseBackend`'s leases (same clock), with reports in a dict."""

    def __init__(self, leases: MemoryLeaseBackend) -> None:
        self._leases = leases
        self._reports: dict[int, LeaderReport] = {}

    def post(self, report: LeaderReport) -> None:
        self._leases._reachable_now()
        self._reports[report.shard] = report

    def read(self, shards: Sequence[int]) -> list[LeaderView]:
        leases = self._leases
        views = []
        with leases._lock:
            now = leases._reachable_now()
            for shard in shards:
                token = leases._live(shard, now)
                ttl = None if token is None else leases._leases[shard][1] - now
                views.append(
                    LeaderView(
                        shard=shard,
                        holder=None if token is None else token_holder(token),
                        ttl=ttl,
                        report=self._reports.get(shard),
                    )
                )
        return views


class MemoryMembership(Membership):
    """:class:`~celery_sched.interfaces.Membership` in a dict ``beat ->
    expires_at`` on ``clock``'s scale; :attr:`available` ``False`` simulates
    an outage (:class:`~celery_sched.errors.LeaseUnavailable`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._beats: dict[str, float] = {}
        self.available = True

    def heartbeat(self, beat: str, ttl: float) -> list[str]:
        if not beat:
            raise ValueError("a beat id must not be empty")
        _check_ttl(ttl)
        with self._lock:
            now = self._reachable_now()
            self._beats = {b: until for b, until in self._beats.items() if until > now}
            self._beats[beat] = now + ttl
            return sorted(self._beats)

    def leave(self, beat: str) -> None:
        with self._lock:
            self._reachable_now()
            self._beats.pop(beat, None)

    def _reachable_now(self) -> float:
        if not self.available:
            raise LeaseUnavailable("the beat membership (memory) is marked unavailable")
        return self._clock()
