"""The LeaseBackend contract, run against the in-memory fake, real Redis and
the primary of a real Redis Sentinel set.

Time is expressed in fractions of the lease ttl: the memory backend moves a
fake clock by exactly that much, the Redis backend sleeps through a short
real ttl. A test passing here on both proves the fake is a faithful stand-in.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from celery_sched.interfaces import LeaseBackend
from celery_sched.lease.memory import MemoryLeaseBackend
from celery_sched.lease.redis import RedisLeaseBackend
from celery_sched.redisconn import build_client
from tests.e2e.harness import delete_keys
from tests.redis_topologies import ClusterSet, masters_of


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclasses.dataclass
class LeaseEnv:
    backend: LeaseBackend
    ttl: float
    advance: Callable[[float], None]

    def after(self, fraction: float) -> None:
        """Let ``fraction`` of the ttl pass."""
        self.advance(fraction * self.ttl)


@pytest.fixture(params=["memory", "redis", "sentinel", "cluster"])
def env(request: pytest.FixtureRequest) -> Iterator[LeaseEnv]:
    if request.param == "memory":
        clock = FakeClock()
        yield LeaseEnv(backend=MemoryLeaseBackend(clock), ttl=10.0, advance=clock.advance)
        return
    prefix = "t_lease_" + uuid.uuid4().hex[:12]
    if request.param == "sentinel":
        # The primary of a real Sentinel set, found through its sentinels.
        url: str = request.getfixturevalue("shared_sentinel_set").url
    elif request.param == "cluster":
        # Three masters of a real Redis Cluster; shards 0-2 on all three.
        cluster: ClusterSet = request.getfixturevalue("shared_cluster_set")
        url, prefix = cluster.url, cluster.spread_prefix(prefix)
    else:
        url = request.getfixturevalue("redis_url")
    client = build_client(url, socket_timeout=2)
    backend = RedisLeaseBackend(client, prefix=prefix)
    if request.param == "cluster":
        assert len(masters_of(client, [backend.key(shard) for shard in range(3)])) == 3
    try:
        # Long enough that a loaded 2-core machine does not expire a lease
        # early between two commands, short enough to keep the suite fast.
        yield LeaseEnv(backend=backend, ttl=0.4, advance=time.sleep)
    finally:
        delete_keys(client, prefix)
        backend.close()
        client.close()


def test_free_lease_has_no_holder(env: LeaseEnv) -> None:
    assert env.backend.holder(0) is None


def test_acquire_is_exclusive(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    assert b.acquire(0, "b", env.ttl) is False
    # SET NX: not even the holder's own token can take it again.
    assert b.acquire(0, "a", env.ttl) is False
    assert b.holder(0) == "a"


def test_shards_are_independent(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    assert b.acquire(1, "b", env.ttl) is True
    assert b.holder(0) == "a"
    assert b.holder(1) == "b"
    assert b.release(0, "a") is True
    assert b.holder(1) == "b"


def test_lease_expires_after_ttl(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    env.after(0.3)
    assert b.holder(0) == "a"
    assert b.acquire(0, "b", env.ttl) is False
    env.after(0.9)
    assert b.holder(0) is None
    assert b.acquire(0, "b", env.ttl) is True
    assert b.holder(0) == "b"


def test_renew_only_by_holder(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    assert b.renew(0, "b", env.ttl) is False
    assert b.holder(0) == "a"
    assert b.renew(0, "a", env.ttl) is True


def test_renew_extends_the_ttl(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    env.after(0.6)
    assert b.renew(0, "a", env.ttl) is True
    # 1.2 ttl after the acquisition, alive only thanks to the renewal.
    env.after(0.6)
    assert b.holder(0) == "a"
    env.after(0.6)
    assert b.holder(0) is None


def test_renew_after_expiry_fails(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    env.after(1.2)
    assert b.renew(0, "a", env.ttl) is False
    assert b.holder(0) is None


def test_renew_cannot_steal_a_successors_lease(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    env.after(1.2)
    assert b.acquire(0, "b", env.ttl) is True
    assert b.renew(0, "a", env.ttl) is False
    assert b.holder(0) == "b"


def test_release_only_by_holder(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    assert b.release(0, "b") is False
    assert b.holder(0) == "a"
    assert b.release(0, "a") is True
    assert b.holder(0) is None
    assert b.release(0, "a") is False
    assert b.acquire(0, "b", env.ttl) is True


def test_stale_holder_cannot_release_successor(env: LeaseEnv) -> None:
    b = env.backend
    assert b.acquire(0, "a", env.ttl) is True
    env.after(1.2)
    assert b.acquire(0, "b", env.ttl) is True
    assert b.release(0, "a") is False
    assert b.holder(0) == "b"


@pytest.mark.parametrize("ttl", [0.0, -1.0])
def test_non_positive_ttl_is_refused(env: LeaseEnv, ttl: float) -> None:
    with pytest.raises(ValueError, match="ttl"):
        env.backend.acquire(0, "a", ttl)
    assert env.backend.acquire(0, "a", env.ttl) is True
    with pytest.raises(ValueError, match="ttl"):
        env.backend.renew(0, "a", ttl)
    assert env.backend.holder(0) == "a"
