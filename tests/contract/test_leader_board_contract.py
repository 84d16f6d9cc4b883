"""The LeaderBoard contract (``sched leader``), on the memory fake and real Redis."""

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
from tests.e2e.harness import delete_keys

PASS_AT = dt.datetime(2031, 5, 1, 10, 0, 0, 250000, tzinfo=dt.UTC)


@pytest.fixture(params=["memory", "redis"])
def board(request: pytest.FixtureRequest) -> Iterator[tuple[LeaseBackend, LeaderBoard]]:
    if request.param == "memory":
        from celery_sched.lease.memory import MemoryLeaderBoard, MemoryLeaseBackend

        leases = MemoryLeaseBackend()
        yield leases, MemoryLeaderBoard(leases)
        return
    from celery_sched.lease.board import RedisLeaderBoard
    from celery_sched.lease.redis import RedisLeaseBackend

    url: str = request.getfixturevalue("redis_url")
    prefix = "t_board_" + uuid.uuid4().hex[:12]
    client: Any = redis.Redis.from_url(url, socket_timeout=2)
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
