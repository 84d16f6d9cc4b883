"""The Membership contract (the live beats of a fleet), run against the
in-memory fake, real Redis and a real Redis Cluster.

Time is in fractions of the listing's ttl: the memory backend moves a fake
clock, the Redis backend sleeps through a short real ttl (Redis's own clock
decides expiry there).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from celery_sched.errors import LeaseUnavailable
from celery_sched.interfaces import Membership
from celery_sched.lease.membership import RedisMembership
from celery_sched.lease.memory import MemoryMembership
from celery_sched.redisconn import build_client
from celery_sched.rediskeys import beats_key
from tests.contract.test_lease_contract import FakeClock
from tests.e2e.harness import delete_keys
from tests.redis_topologies import ClusterSet


@dataclasses.dataclass
class MembershipEnv:
    membership: Membership
    ttl: float
    advance: Callable[[float], None]

    def after(self, fraction: float) -> None:
        self.advance(fraction * self.ttl)


@pytest.fixture(params=["memory", "redis", "cluster"])
def env(request: pytest.FixtureRequest) -> Iterator[MembershipEnv]:
    if request.param == "memory":
        clock = FakeClock()
        yield MembershipEnv(MemoryMembership(clock), ttl=10.0, advance=clock.advance)
        return
    prefix = "t_beats_" + uuid.uuid4().hex[:12]
    if request.param == "cluster":
        cluster: ClusterSet = request.getfixturevalue("shared_cluster_set")
        url = cluster.url
    else:
        url = request.getfixturevalue("redis_url")
    client = build_client(url, socket_timeout=2)
    try:
        yield MembershipEnv(RedisMembership(client, prefix=prefix), ttl=0.5, advance=time.sleep)
    finally:
        delete_keys(client, prefix)
        client.close()


def test_a_heartbeat_lists_the_beat_and_returns_every_live_one_sorted(
    env: MembershipEnv,
) -> None:
    assert env.membership.heartbeat("b", env.ttl) == ["b"]
    assert env.membership.heartbeat("c", env.ttl) == ["b", "c"]
    assert env.membership.heartbeat("a", env.ttl) == ["a", "b", "c"]
    # A second heartbeat of a listed beat lists it once.
    assert env.membership.heartbeat("b", env.ttl) == ["a", "b", "c"]


def test_a_beat_that_stops_beating_drops_out_after_its_ttl(env: MembershipEnv) -> None:
    env.membership.heartbeat("gone", env.ttl)
    env.after(0.5)
    assert env.membership.heartbeat("stays", env.ttl) == ["gone", "stays"]
    env.after(0.7)  # 1.2 ttl after gone's last beat, 0.7 after stays'
    assert env.membership.heartbeat("stays", env.ttl) == ["stays"]


def test_heartbeats_keep_a_beat_listed_past_its_first_ttl(env: MembershipEnv) -> None:
    for _ in range(4):
        env.membership.heartbeat("steady", env.ttl)
        env.after(0.4)
    assert env.membership.heartbeat("other", env.ttl) == ["other", "steady"]


def test_leaving_drops_a_beat_at_once(env: MembershipEnv) -> None:
    env.membership.heartbeat("a", env.ttl)
    env.membership.heartbeat("b", env.ttl)
    env.membership.leave("a")
    assert env.membership.heartbeat("b", env.ttl) == ["b"]
    env.membership.leave("never-listed")  # no error


def test_an_empty_beat_id_is_refused(env: MembershipEnv) -> None:
    with pytest.raises(ValueError, match="beat id"):
        env.membership.heartbeat("", env.ttl)


def test_the_set_of_beats_has_its_own_hash_tag() -> None:
    assert beats_key("proj") == "{proj}:beats"
    with pytest.raises(ValueError, match="brace"):
        beats_key("a{b")


def test_an_unreachable_redis_is_lease_unavailable() -> None:
    client = build_client("redis://127.0.0.1:1/0", socket_timeout=0.2, socket_connect_timeout=0.2)
    membership = RedisMembership(client, prefix="t_beats_down")
    with pytest.raises(LeaseUnavailable, match="cannot be reached"):
        membership.heartbeat("a", 1.0)
    memory = MemoryMembership()
    memory.available = False
    with pytest.raises(LeaseUnavailable):
        memory.heartbeat("a", 1.0)
