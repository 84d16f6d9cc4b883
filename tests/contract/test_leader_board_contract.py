"""The LeaderBoard contract (``sched leader``), on the memory fake, real Redis and
a real Redis Cluster (shards on different masters)."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_sched.interfaces import LeaderBoard, LeaseBackend
from celery_sched.lease.elector import lease_token
from celery_sched.models import LeaderReport
from celery_sched.redisconn import build_client
from celery_sched.rediskeys import shard_keys
from tests.e2e.harness import delete_keys
from tests.redis_topologies import ClusterSet, masters_of

PASS_AT = dt.datetime(2031, 5, 1, 10, 0, 0, 250000, tzinfo=dt.UTC)


@pytest.fixture(params=["memory", "redis", "cluster"])
def board(request: pytest.FixtureRequest) -> Iterator[tuple[LeaseBackend, LeaderBoard]]:
    if request.param == "memory":
        from celery_sched.lease.memory import MemoryLeaderBoard, MemoryLeaseBackend

        leases = MemoryLeaseBackend()
        yield leases, MemoryLeaderBoard(leases)
        return
    from celery_sched.lease.board import RedisLeaderBoard
    from celery_sched.lease.redis import RedisLeaseBackend

    prefix = "t_board_" + uuid.uuid4().hex[:12]
    client: Any
    if request.param == "cluster":
        cluster: ClusterSet = request.getfixturevalue("shared_cluster_set")
        prefix = cluster.spread_prefix(prefix)
        client = build_client(cluster.url, socket_timeout=2)
        assert len(masters_of(client, [shard_keys(prefix, s).leader for s in range(3)])) == 3
    else:
        client = redis.Redis.from_url(request.getfixturevalue("redis_url"), socket_timeout=2)
    try:
        yield RedisLeaseBackend(client, prefix=prefix), RedisLeaderBoard(client, prefix=prefix)
    finally:
        delete_keys(client, prefix)
        client.close()


def test_an_empty_board_shows_no_leader(board: tuple[LeaseBackend, LeaderBoard]) -> None:
    _, leaders = board
    views = leaders.read([0, 1])
    assert [(v.shard, v.holder, v.ttl, v.report) for v in views] == [
        (0, None, None, None),
        (1, None, None, None),
    ]


def test_the_holder_its_time_left_and_the_last_report(
    board: tuple[LeaseBackend, LeaderBoard],
) -> None:
    leases, leaders = board
    assert leases.acquire(1, lease_token("host-a:4242"), 30.0)
    report = LeaderReport(shard=1, host="host-a", pid=4242, epoch=7, pass_at=PASS_AT)
    leaders.post(report)
    free, held = leaders.read([0, 1])
    assert free.holder is None and free.report is None
    assert held.holder == "host-a:4242"
    assert held.ttl is not None and 25.0 < held.ttl <= 30.0
    assert held.report == report
    # A later post replaces the report; it outlives the lease.
    later = LeaderReport(shard=1, host="host-b", pid=1, epoch=8, pass_at=PASS_AT)
    leaders.post(later)
    token = leases.holder(1)
    assert token is not None and leases.release(1, token)
    (after,) = leaders.read([1])
    assert (after.holder, after.ttl, after.report) == (None, None, later)
