"""The rolling upgrade to hash-tagged keys (#17): old and new beats competing
for one shard on one Redis are never both leaders while the new beats hold
the legacy key too (``celery_sched_legacy_lease_keys``), and are no longer
excluded once it is off; a leader elected then retires the old staging set.

The old beat here is :class:`OldLease`: the commands the lease before hash
tags sent (``git show ff82a11:celery_sched/lease/redis.py`` and its two Lua
files), on its key ``<prefix>:lease:<shard>``. What excludes beats from one
another is what reaches Redis, so the test replays those commands verbatim
(``SET NX PX``, and the old renew/release scripts' text) rather than
importing the old module, whose scripts would now load the new Lua files.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Protocol

import pytest
import redis

from celery_sched.lease.redis import RedisLeaseBackend, lease_key
from celery_sched.rediskeys import legacy_lease_key
from celery_sched.settings import Settings
from tests.e2e.harness import delete_keys

pytestmark = pytest.mark.integration

#: The pre-change celery_sched/lease/lua/renew.lua and celery_sched/lease/lua/release.lua
#: (at ff82a11), verbatim but for comments.
OLD_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
OLD_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

TTL = 0.3
#: How long before its expiry a contender stops trusting its lease (the
#: elector's safety margin), so a trust interval ends before Redis frees the key.
MARGIN = 0.05
SHARD = 0


class Lease(Protocol):
    def acquire(self, shard: int, token: str, ttl: float) -> bool: ...
    def renew(self, shard: int, token: str, ttl: float) -> bool: ...
    def release(self, shard: int, token: str) -> bool: ...


class OldLease:
    """The lease of beats before hash tags, as Redis sees it."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self._client = client
        self._key = legacy_lease_key(prefix, SHARD)
        self._renew = client.register_script(OLD_RENEW)
        self._release = client.register_script(OLD_RELEASE)

    def acquire(self, shard: int, token: str, ttl: float) -> bool:
        return bool(self._client.set(self._key, token, nx=True, px=round(ttl * 1000)))

    def renew(self, shard: int, token: str, ttl: float) -> bool:
        return bool(self._renew(keys=[self._key], args=[token, round(ttl * 1000)]))

    def release(self, shard: int, token: str) -> bool:
        return bool(self._release(keys=[self._key], args=[token]))


@dataclasses.dataclass
class Contender:
    """One beat's lease loop: acquire, renew a few times, then release or
    let the lease expire; records the intervals in which it trusted its lease."""

    name: str
    lease: Lease
    seed: int
    intervals: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    errors: list[BaseException] = dataclasses.field(default_factory=list)
    held: threading.Event = dataclasses.field(default_factory=threading.Event)

    def run(self, stop: threading.Event) -> None:
        rng = random.Random(self.seed)
        try:
            while not stop.is_set():
                self._round(rng)
                time.sleep(rng.uniform(0.0, 0.02))
        except BaseException as exc:  # surfaced by the test
            self.errors.append(exc)

    def _round(self, rng: random.Random) -> None:
        token = f"{self.name}:{uuid.uuid4().hex}"
        before = time.monotonic()
        if not self.lease.acquire(SHARD, token, TTL):
            return
        start, deadline = time.monotonic(), before + TTL - MARGIN
        self.held.set()
        for _ in range(rng.randint(0, 3)):
            time.sleep(TTL / 3)
            before = time.monotonic()
            if not self.lease.renew(SHARD, token, TTL):
                break
            deadline = before + TTL - MARGIN
        if rng.random() < 0.5:
            # Stop trusting before the release, as the elector does.
            self.intervals.append((start, min(time.monotonic(), deadline)))
            self.lease.release(SHARD, token)
        else:
            # Walk away; Redis expires the lease.
            self.intervals.append((start, deadline))
            time.sleep(max(0.0, deadline - time.monotonic()))


@pytest.fixture
def prefix() -> str:
    return "t_upgrade_" + uuid.uuid4().hex[:12]


@pytest.fixture
def client(redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    yield client
    delete_keys(client, prefix)
    client.close()


def _compete(
    client: redis.Redis, prefix: str, first: Contender, second: Contender, seconds: float
) -> list[str]:
    """Run ``first``, then (once it leads) ``second``, for ``seconds``; return
    the sampled instants at which the two keys named two different holders."""
    stop = threading.Event()
    keys = [lease_key(prefix, SHARD), legacy_lease_key(prefix, SHARD)]
    split: list[str] = []

    def sample() -> None:
        while not stop.is_set():
            values = {value for value in client.mget(keys) if value is not None}
            if len(values) > 1:
                split.append(repr(values))
            time.sleep(0.002)

    threads = [threading.Thread(target=first.run, args=(stop,), daemon=True)]
    threads[0].start()
    assert first.held.wait(5), f"{first.name} never led"
    threads.append(threading.Thread(target=second.run, args=(stop,), daemon=True))
    threads.append(threading.Thread(target=sample, daemon=True))
    for thread in threads[1:]:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(10)
    assert not first.errors and not second.errors, first.errors + second.errors
    return split


def _overlaps(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[str]:
    return [f"{x} overlaps {y}" for x in a for y in b if max(x[0], y[0]) < min(x[1], y[1])]


@pytest.mark.parametrize("new_first", [True, False], ids=["new-first", "old-first"])
def test_old_and_new_beats_never_lead_one_shard_together(
    client: redis.Redis, prefix: str, new_first: bool
) -> None:
    new_backend = RedisLeaseBackend(client, prefix=prefix, legacy_keys=True)
    try:
        new = Contender("new", new_backend, seed=1)
        old = Contender("old", OldLease(client, prefix), seed=2)
        first, second = (new, old) if new_first else (old, new)
        split = _compete(client, prefix, first, second, seconds=8)
    finally:
        new_backend.close()
    # Many rounds of both, so the two really competed for the shard...
    assert len(new.intervals) >= 5 and len(old.intervals) >= 5, (
        len(new.intervals),
        len(old.intervals),
    )
    # ... and never trusted the lease at the same time, nor did Redis ever
    # hold the two keys for two different beats.
    assert _overlaps(new.intervals, old.intervals) == []
    assert split == []


def test_with_legacy_keys_off_an_old_beat_is_no_longer_excluded(
    client: redis.Redis, prefix: str
) -> None:
    """Why ``celery_sched_legacy_lease_keys`` must stay on until no old beat
    runs: without the legacy key, an old beat sees the shard free while a
    new one leads it (and the other way round), and both lead it. Only the
    PostgreSQL epoch would then keep one of them from claiming."""
    new = RedisLeaseBackend(client, prefix=prefix, legacy_keys=False)
    old = OldLease(client, prefix)
    try:
        assert new.acquire(SHARD, "new:1", 5.0)
        assert old.acquire(SHARD, "old:1", 5.0)
        assert new.holder(SHARD) == "new:1"
        assert client.get(legacy_lease_key(prefix, SHARD)) == b"old:1"
        assert new.release(SHARD, "new:1") and old.release(SHARD, "old:1")
        # With it on, each excludes the other, whichever comes first.
        held = RedisLeaseBackend(client, prefix=prefix, legacy_keys=True)
        try:
            assert held.acquire(SHARD, "new:2", 5.0)
            assert not old.acquire(SHARD, "old:2", 5.0)
            assert held.release(SHARD, "new:2")
            assert old.acquire(SHARD, "old:3", 5.0)
            assert not held.acquire(SHARD, "new:3", 5.0)
            # The new beat reports the old leader as the holder.
            assert held.holder(SHARD) == "old:3"
        finally:
            held.close()
    finally:
        new.close()


def test_a_new_beat_whose_legacy_key_was_taken_does_not_renew(
    client: redis.Redis, prefix: str
) -> None:
    """If the legacy key lapses under a new leader (and an old beat takes
    it), the new leader's renewal fails, so it steps down rather than lead
    beside the old beat; its release leaves the old beat's key alone."""
    new = RedisLeaseBackend(client, prefix=prefix, legacy_keys=True)
    old = OldLease(client, prefix)
    try:
        assert new.acquire(SHARD, "new:1", 5.0)
        client.delete(legacy_lease_key(prefix, SHARD))
        assert old.acquire(SHARD, "old:1", 5.0)
        assert not new.renew(SHARD, "new:1", 5.0)
        assert new.release(SHARD, "new:1")
        assert client.get(legacy_lease_key(prefix, SHARD)) == b"old:1"
        assert client.exists(lease_key(prefix, SHARD)) == 0
    finally:
        new.close()


def test_the_leader_board_shows_an_old_leader_during_the_upgrade(
    client: redis.Redis, prefix: str
) -> None:
    from celery_sched.lease.board import RedisLeaderBoard

    old = OldLease(client, prefix)
    assert old.acquire(SHARD, "oldhost:41:abc", 5.0)
    (view,) = RedisLeaderBoard(client, prefix=prefix).read([SHARD])
    assert view.holder == "oldhost:41"
    assert view.ttl is not None and 0 < view.ttl <= 5.0


def test_a_leader_elected_with_legacy_keys_off_retires_the_old_staging_set(
    settings: Settings,
) -> None:
    # The last step of the upgrade: no old beat runs, the legacy key is off.
    # A job an old client staged only in the old set is then popped from the
    # new one at its due time, and the old set is gone.
    from celery_sched.backends import build_lease, build_redis, build_staging, build_store
    from celery_sched.dispatch.memory import MemoryDispatcher
    from celery_sched.leader import Engine
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.rediskeys import legacy_staging_key
    from tests.contract.conftest import new_job

    settings = dataclasses.replace(settings, legacy_lease_keys=False, staging_window=60.0)
    store = build_store(settings)
    store.migrate()
    client = build_redis(settings)
    staging = build_staging(settings, client)
    elector = LeaderElector(
        build_lease(settings, client),
        shard=0,
        ttl=5.0,
        safety_margin=0.5,
        acquire_epoch=store.acquire_epoch,
        holder="new:1",
    )
    dispatcher = MemoryDispatcher()
    engine = Engine(
        store=store, staging=staging, dispatcher=dispatcher, elector=elector, settings=settings
    )
    legacy = legacy_staging_key(settings.key_prefix, 0)
    try:
        job = new_job("staged-by-an-old-client", store.now() + dt.timedelta(seconds=1))
        store.add_job(job)
        client.zadd(legacy, {job.id.hex: job.due_at.timestamp()})

        assert elector.try_acquire() is not None
        engine.step()
        assert client.exists(legacy) == 0
        assert client.zscore(staging.key(0), job.id.hex) == job.due_at.timestamp()
        deadline = time.monotonic() + 10
        while job.id not in dispatcher.sent_ids() and time.monotonic() < deadline:
            time.sleep(engine.step())
        assert dispatcher.sent_ids() == [job.id]
    finally:
        engine.stop()
        client.close()
        store.close()
