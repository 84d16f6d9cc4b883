"""The leader lease against a real Redis: key layout, scripts, outages, and
two electors with real threads competing for one shard."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from celery_sched.errors import LeaseUnavailable
from celery_sched.interfaces import LeaseBackend
from celery_sched.lease.elector import LeaderElector
from celery_sched.lease.redis import RedisLeaseBackend, lease_key
from tests.e2e.harness import delete_keys

pytestmark = pytest.mark.integration


@pytest.fixture
def prefix() -> str:
    return "t_lease_" + uuid.uuid4().hex[:12]


@pytest.fixture
def client(redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    yield client
    delete_keys(client, prefix)
    client.close()


@pytest.fixture
def backend(client: redis.Redis, prefix: str) -> Iterator[RedisLeaseBackend]:
    backend = RedisLeaseBackend(client, prefix=prefix)
    yield backend
    backend.close()


class Epochs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def __call__(self, shard: int, holder: str) -> int:
        with self._lock:
            self.value += 1
            return self.value


# -- the backend ----------------------------------------------------------------


def test_lease_key_layout_and_expiry(
    backend: RedisLeaseBackend, client: redis.Redis, prefix: str
) -> None:
    assert backend.acquire(3, "beat-a:1", 5.0)
    # The whole per-shard identity is the hash tag (celery_sched/rediskeys.py).
    key = "{" + prefix + ":3}:lease"
    assert backend.key(3) == key
    assert backend.keys(3) == [key]
    assert client.get(key) == b"beat-a:1"
    pttl = client.pttl(key)
    assert 4000 < pttl <= 5000
    assert backend.renew(3, "beat-a:1", 20.0)
    assert 19000 < client.pttl(key) <= 20000
    # A rival's renewal leaves the ttl alone.
    assert not backend.renew(3, "beat-b:1", 1.0)
    assert client.pttl(key) > 19000
    assert backend.release(3, "beat-a:1")
    assert client.exists(key) == 0


def test_scripts_reload_after_noscript(backend: RedisLeaseBackend, client: redis.Redis) -> None:
    assert backend.acquire(0, "tok", 5.0)
    # Pretend Redis lost its script cache (restart, SCRIPT FLUSH elsewhere)
    # by pointing the registered scripts at a SHA Redis has never seen.
    backend._renew.sha = "0" * 40
    backend._release.sha = "0" * 40
    assert backend.renew(0, "tok", 5.0)
    assert backend.release(0, "tok")
    assert backend.holder(0) is None


def test_unreachable_redis_fails_fast_as_lease_unavailable(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nothing listens on port 1. The client keeps redis-py's default retry
    # policy (ten retries with backoff); the lease must not inherit it.
    dead = redis.Redis(host="127.0.0.1", port=1, password="s3cret-pw", socket_timeout=0.5)
    backend = RedisLeaseBackend(dead, prefix="t_dead")
    with caplog.at_level(logging.DEBUG):
        for op in (
            lambda: backend.acquire(0, "tok", 1.0),
            lambda: backend.renew(0, "tok", 1.0),
            lambda: backend.release(0, "tok"),
            lambda: backend.holder(0),
        ):
            started = time.monotonic()
            with pytest.raises(LeaseUnavailable):
                op()
            assert time.monotonic() - started < 0.5
    assert caplog.records, "the quick retry should log a warning"
    assert all("s3cret-pw" not in r.getMessage() for r in caplog.records)
    # One quick retry per operation, no more.
    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 4


def test_hung_redis_times_out_without_a_retry() -> None:
    # Accepts connections and never answers: a frozen or overloaded server.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        hung = redis.Redis(host="127.0.0.1", port=port, socket_timeout=5)
        backend = RedisLeaseBackend(hung, prefix="t_hung", op_timeout=0.2)
        started = time.monotonic()
        with pytest.raises(LeaseUnavailable):
            backend.renew(0, "tok", 3.0)
        took = time.monotonic() - started
        # op_timeout, not the client's 5 s, and not retried: a slow Redis
        # must not eat the renewal period (ttl/3 = 1 s here).
        assert 0.15 <= took < 0.35
        backend.close()
    finally:
        listener.close()


def test_elector_on_unreachable_redis_stays_standby() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1)
    epochs = Epochs()
    elector = LeaderElector(
        RedisLeaseBackend(dead, prefix="t_dead"),
        shard=0,
        ttl=1.0,
        safety_margin=0.1,
        acquire_epoch=epochs,
        holder="beat-a",
    )
    assert elector.try_acquire() is None
    assert not elector.is_leader()
    assert epochs.value == 0


# -- two electors with real threads ----------------------------------------------------

TTL = 1.0
MARGIN = 0.1


class FreezableBackend(LeaseBackend):
    """Blocks the elector's calls while frozen: a stuck or paused process."""

    def __init__(self, inner: LeaseBackend) -> None:
        self.inner = inner
        self.thawed = threading.Event()
        self.thawed.set()

    def freeze(self) -> None:
        self.thawed.clear()

    def thaw(self) -> None:
        self.thawed.set()

    def acquire(self, shard: int, token: str, ttl: float) -> bool:
        self.thawed.wait()
        return self.inner.acquire(shard, token, ttl)

    def renew(self, shard: int, token: str, ttl: float) -> bool:
        self.thawed.wait()
        return self.inner.renew(shard, token, ttl)

    def release(self, shard: int, token: str) -> bool:
        return self.inner.release(shard, token)

    def holder(self, shard: int) -> str | None:
        return self.inner.holder(shard)


def leaders(electors: list[LeaderElector]) -> list[LeaderElector]:
    return [e for e in electors if e.is_leader()]


def test_one_leader_at_a_time_and_failover_after_a_freeze(client: redis.Redis, prefix: str) -> None:
    epochs = Epochs()
    backends = [FreezableBackend(RedisLeaseBackend(client, prefix=prefix)) for _ in range(2)]
    electors = [
        LeaderElector(
            b,
            shard=0,
            ttl=TTL,
            safety_margin=MARGIN,
            acquire_epoch=epochs,
            holder=f"beat-{i}",
        )
        for i, b in enumerate(backends)
    ]
    for e in electors:
        e.start()
    try:
        deadline = time.monotonic() + 2.0
        while not leaders(electors):
            assert time.monotonic() < deadline, "nobody was elected"
            time.sleep(0.005)

        # A few seconds of steady state, sampled often: always exactly one.
        first = leaders(electors)[0]
        first_lease = first.current()
        assert first_lease is not None
        end = time.monotonic() + 3 * TTL
        while time.monotonic() < end:
            assert leaders(electors) == [first]
            time.sleep(0.005)
        assert client.get(lease_key(prefix, 0)) == first_lease.token.encode()

        # Freeze the leader's thread mid-term: no more renewals.
        index = electors.index(first)
        other = electors[1 - index]
        backends[index].freeze()
        frozen_at = time.monotonic()
        first_gave_up_at: float | None = None
        while not other.is_leader():
            now_leading = leaders(electors)
            assert len(now_leading) <= 1
            if first_gave_up_at is None and not first.is_leader():
                first_gave_up_at = time.monotonic()
            assert time.monotonic() - frozen_at < 3 * TTL, "no failover"
            time.sleep(0.002)
        took_over_at = time.monotonic()
        # The frozen leader distrusted its lease on its own before the
        # successor was elected (no renewal ever told it so).
        assert first_gave_up_at is not None
        assert first_gave_up_at <= took_over_at
        assert took_over_at - frozen_at <= TTL + TTL / 3 + 0.25
        second_lease = other.current()
        assert second_lease is not None
        assert second_lease.epoch > first_lease.epoch
        assert not first.is_leader()

        # Thawed, the old leader's pending renewal fails and it stays down.
        backends[index].thaw()
        end = time.monotonic() + 2 * TTL
        while time.monotonic() < end:
            assert leaders(electors) == [other]
            time.sleep(0.005)
        assert client.get(lease_key(prefix, 0)) == second_lease.token.encode()
    finally:
        for b in backends:
            b.thaw()
        for e in electors:
            e.stop()
    assert client.exists(lease_key(prefix, 0)) == 0
