"""The Staging contract: the in-memory fake, real Redis and the primary of a
real Redis Sentinel set behave the same."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator

import pytest

from celery_sched.interfaces import Staging
from celery_sched.redisconn import build_client
from celery_sched.staging import MemoryStaging, RedisStaging
from tests.e2e.harness import delete_keys
from tests.redis_topologies import ClusterSet, masters_of

T0 = dt.datetime(2030, 5, 17, 12, 0, 0, 123456, tzinfo=dt.UTC)


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def ids(n: int) -> list[uuid.UUID]:
    return [uuid.uuid4() for _ in range(n)]


@pytest.fixture(params=["memory", "redis", "sentinel", "cluster"])
def staging(request: pytest.FixtureRequest, unique_name: str) -> Iterator[Staging]:
    if request.param == "memory":
        yield MemoryStaging()
        return
    prefix = unique_name
    if request.param == "sentinel":
        # The primary of a real Sentinel set, found through its sentinels.
        url: str = request.getfixturevalue("shared_sentinel_set").url
    elif request.param == "cluster":
        # Three masters of a real Redis Cluster; shards 0-2 on all three.
        cluster: ClusterSet = request.getfixturevalue("shared_cluster_set")
        url, prefix = cluster.url, cluster.spread_prefix(unique_name)
    else:
        url = request.getfixturevalue("redis_url")
    client = build_client(url)
    staging = RedisStaging(client, prefix=prefix)
    if request.param == "cluster":
        assert len(masters_of(client, [staging.key(shard) for shard in range(3)])) == 3
    try:
        yield staging
    finally:
        delete_keys(client, prefix)
        client.close()


def test_add_counts_only_new_ids(staging: Staging) -> None:
    a, b, c = ids(3)
    assert staging.add(0, [(a, at(1)), (b, at(2))]) == 2
    assert staging.add(0, [(a, at(1)), (c, at(3))]) == 1
    assert staging.add(0, []) == 0
    assert staging.size(0) == 3


def test_readding_an_id_moves_it_without_counting_it(staging: Staging) -> None:
    a, b = ids(2)
    staging.add(0, [(a, at(10)), (b, at(20))])
    assert staging.add(0, [(a, at(30))]) == 0
    assert staging.size(0) == 2
    assert staging.next_due(0) == at(20)
    # a now sorts after b, and is no longer due at its old time.
    assert staging.pop_due(0, at(25), 10) == [b]
    assert staging.pop_due(0, at(30), 10) == [a]


def test_duplicate_id_within_one_batch_counts_once_and_last_wins(staging: Staging) -> None:
    (a,) = ids(1)
    assert staging.add(0, [(a, at(5)), (a, at(7))]) == 1
    assert staging.size(0) == 1
    assert staging.next_due(0) == at(7)


def test_pop_due_returns_due_ids_earliest_first_and_removes_them(staging: Staging) -> None:
    jobs = ids(6)
    # Staged out of order, with one exactly at "now" (inclusive) and two in the future.
    offsets = [3.0, -60.0, 0.0, 0.5, 1.0, -1.0]
    staging.add(0, list(zip(jobs, (at(s) for s in offsets), strict=True)))
    by_time = [j for _, j in sorted(zip(offsets, jobs, strict=True))]

    popped = staging.pop_due(0, at(0), 100)
    assert popped == by_time[:3]  # -60, -1, 0
    assert staging.size(0) == 3
    assert staging.pop_due(0, at(0), 100) == []
    assert staging.next_due(0) == at(0.5)
    assert staging.pop_due(0, at(10), 100) == by_time[3:]
    assert staging.size(0) == 0


def test_pop_due_takes_at_most_limit_in_order(staging: Staging) -> None:
    jobs = ids(25)
    staging.add(0, [(j, at(i)) for i, j in enumerate(jobs)])
    assert staging.pop_due(0, at(100), 10) == jobs[:10]
    assert staging.pop_due(0, at(100), 10) == jobs[10:20]
    assert staging.pop_due(0, at(100), 10) == jobs[20:]
    assert staging.pop_due(0, at(100), 0) == []
    assert staging.size(0) == 0


def test_pop_due_drops_ids_through_the_given_time_unreturned(staging: Staging) -> None:
    jobs = ids(6)
    staging.add(0, [(j, at(i)) for i, j in enumerate(jobs)])  # due at 0 .. 5
    # Through 2 (inclusive) are dropped; of the rest, those due by 4 come back.
    assert staging.pop_due(0, at(4), 10, drop_through=at(2)) == jobs[3:5]
    assert staging.size(0) == 1
    assert staging.next_due(0) == at(5)
    # A drop time past "now" drops the future too, and returns nothing.
    assert staging.pop_due(0, at(0), 10, drop_through=at(9)) == []
    assert staging.size(0) == 0


def test_pop_due_with_zero_limit_drops_nothing(staging: Staging) -> None:
    (a,) = ids(1)
    staging.add(0, [(a, at(0))])
    assert staging.pop_due(0, at(0), 0, drop_through=at(1)) == []
    assert staging.size(0) == 1


def test_equal_scores_pop_in_member_order(staging: Staging) -> None:
    jobs = ids(20)
    staging.add(0, [(j, at(0)) for j in jobs])
    popped = staging.pop_due(0, at(0), 7) + staging.pop_due(0, at(0), 100)
    # Redis orders equal scores by member bytes; the fake must agree.
    assert popped == sorted(jobs, key=lambda j: j.hex)


def test_negative_limit_is_refused(staging: Staging) -> None:
    staging.add(0, [(uuid.uuid4(), at(0))])
    with pytest.raises(ValueError, match="limit"):
        staging.pop_due(0, at(0), -1)
    assert staging.size(0) == 1


def test_naive_datetimes_are_refused(staging: Staging) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        staging.add(0, [(uuid.uuid4(), dt.datetime(2030, 1, 1))])
    with pytest.raises(ValueError, match="timezone-aware"):
        staging.pop_due(0, dt.datetime(2030, 1, 1), 10)
    with pytest.raises(ValueError, match="timezone-aware"):
        staging.pop_due(0, at(0), 10, drop_through=dt.datetime(2030, 1, 1))
    assert staging.size(0) == 0


def test_empty_shard(staging: Staging) -> None:
    assert staging.pop_due(3, at(1e6), 1000) == []
    assert staging.next_due(3) is None
    assert staging.size(3) == 0
    assert staging.remove(3, ids(2)) == 0


def test_next_due_round_trips_microseconds_and_other_zones(staging: Staging) -> None:
    a, b = ids(2)
    tokyo = dt.timezone(dt.timedelta(hours=9))
    staging.add(0, [(a, at(42.000001).astimezone(tokyo)), (b, at(43))])
    first = staging.next_due(0)
    assert first == at(42.000001)
    assert first is not None and first.utcoffset() == dt.timedelta(0)


def test_remove_unstages_and_counts_only_staged_ids(staging: Staging) -> None:
    a, b, c = ids(3)
    staging.add(0, [(a, at(1)), (b, at(2)), (c, at(3))])
    assert staging.remove(0, [a, uuid.uuid4(), c]) == 2
    assert staging.remove(0, [a]) == 0
    assert staging.size(0) == 1
    assert staging.pop_due(0, at(10), 10) == [b]


def test_shards_are_independent(staging: Staging) -> None:
    a, b = ids(2)
    staging.add(0, [(a, at(1))])
    staging.add(1, [(b, at(2))])
    assert staging.remove(1, [a]) == 0
    assert staging.pop_due(0, at(5), 10) == [a]
    assert staging.size(0) == 0
    assert staging.size(1) == 1
    assert staging.next_due(1) == at(2)
    assert staging.pop_due(1, at(5), 10) == [b]


def test_ids_round_trip_as_uuids(staging: Staging) -> None:
    jobs = [uuid.UUID(int=0), uuid.UUID(int=2**128 - 1), uuid.uuid1(), uuid.uuid4()]
    staging.add(0, [(j, at(i)) for i, j in enumerate(jobs)])
    popped = staging.pop_due(0, at(10), 10)
    assert popped == jobs
    assert all(type(p) is uuid.UUID for p in popped)


def test_large_batch_add_and_pop(staging: Staging) -> None:
    # Spans several ZADD chunks (10,000 per command) in one pipeline.
    jobs = ids(25_000)
    assert staging.add(0, [(j, at(i / 1000)) for i, j in enumerate(jobs)]) == 25_000
    assert staging.size(0) == 25_000
    assert staging.remove(0, jobs[:12_000]) == 12_000
    popped = staging.pop_due(0, at(30), 20_000)
    assert popped == jobs[12_000:]
    assert staging.size(0) == 0


def test_drop_legacy_without_a_legacy_set_leaves_the_staged_ids(staging: Staging) -> None:
    a, b = ids(2)
    staging.add(0, [(a, at(1)), (b, at(2))])
    assert staging.drop_legacy(0) == 0
    assert staging.drop_legacy(1) == 0
    assert staging.size(0) == 2
    assert staging.pop_due(0, at(2), 10) == [a, b]
