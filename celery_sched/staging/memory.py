"""In-memory staging for unit tests: the Redis sorted set's semantics, no I/O.

Ordering matches Redis exactly: by score (epoch seconds, the same float the
Redis backend stores), then by member (the id's hex string), so the contract
suite can compare both backends result for result.
"""

from __future__ import annotations

import bisect
import datetime as dt
import threading
import uuid
from collections.abc import Iterable

from celery_sched.interfaces import Staging
from celery_sched.timeutil import ensure_utc, from_epoch_seconds, to_epoch_seconds


class _SortedSet:
    """One shard: a score per member plus the ``(score, member)`` order."""

    __slots__ = ("order", "scores")

    def __init__(self) -> None:
        self.scores: dict[str, float] = {}
        self.order: list[tuple[float, str]] = []

    def add(self, member: str, score: float) -> bool:
        old = self.scores.get(member)
        if old is not None:
            if old == score:
                return False
            self._unlink(member, old)
        self.scores[member] = score
        bisect.insort(self.order, (score, member))
        return old is None

    def discard(self, member: str) -> bool:
        score = self.scores.pop(member, None)
        if score is None:
            return False
        self._unlink(member, score)
        return True

    def pop_through(self, score: float, limit: int | None = None) -> list[tuple[float, str]]:
        """Remove and return the members scored at or before ``score``, earliest
        first (at most ``limit``)."""
        # Everything sorting before (score, +inf) has a score <= score.
        end = bisect.bisect_right(self.order, (score, "\uffff"))
        taken = self.order[: end if limit is None else min(end, limit)]
        del self.order[: len(taken)]
        for _, member in taken:
            del self.scores[member]
        return taken

    def _unlink(self, member: str, score: float) -> None:
        index = bisect.bisect_left(self.order, (score, member))
        del self.order[index]


class MemoryStaging(Staging):
    """:class:`~celery_sched.interfaces.Staging` in process memory; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[int, _SortedSet] = {}

    def _shard(self, shard: int) -> _SortedSet:
        found = self._shards.get(shard)
        if found is None:
            found = self._shards[shard] = _SortedSet()
        return found

    def add(self, shard: int, items: Iterable[tuple[uuid.UUID, dt.datetime]]) -> int:
        # Converted before locking so a bad datetime leaves the set untouched,
        # as a rejected ZADD would.
        pairs = [
            (job_id.hex, to_epoch_seconds(ensure_utc(due_at, name="due_at")))
            for job_id, due_at in items
        ]
        with self._lock:
            zset = self._shard(shard)
            return sum(zset.add(member, score) for member, score in pairs)

    def pop_due(
        self,
        shard: int,
        now: dt.datetime,
        limit: int,
        *,
        drop_through: dt.datetime | None = None,
    ) -> list[uuid.UUID]:
        max_score, drop_score = self.pop_scores(now, limit, drop_through)
        if limit == 0:
            return []
        with self._lock:
            zset = self._shard(shard)
            if drop_score is not None:
                zset.pop_through(drop_score)
            taken = zset.pop_through(max_score, limit)
        return [uuid.UUID(hex=member) for _, member in taken]

    def next_due(self, shard: int) -> dt.datetime | None:
        with self._lock:
            order = self._shard(shard).order
            return from_epoch_seconds(order[0][0]) if order else None

    def remove(self, shard: int, ids: Iterable[uuid.UUID]) -> int:
        members = [job_id.hex for job_id in ids]
        with self._lock:
            zset = self._shard(shard)
            return sum(zset.discard(member) for member in members)

    def size(self, shard: int) -> int:
        with self._lock:
            return len(self._shard(shard).scores)

    def clear(self, shard: int | None = None) -> None:
        """Forget one shard or all of them (what a Redis FLUSHALL does to the real one)."""
        with self._lock:
            if shard is None:
                self._shards.clear()
            else:
                self._shards.pop(shard, None)
