"""RedisStaging against a real Redis: atomic pops, outages, lost keys."""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

import celery_sched.staging.redis as staging_redis
from celery_sched.errors import StagingUnavailable
from celery_sched.rediskeys import legacy_staging_key
from celery_sched.staging import RedisStaging
from tests.e2e.harness import delete_keys

pytestmark = pytest.mark.integration

NOW = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def client(redis_url: str, unique_name: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url)
    try:
        yield conn
    finally:
        delete_keys(conn, unique_name)
        conn.close()


@pytest.fixture
def staging(client: redis.Redis, unique_name: str) -> RedisStaging:
    return RedisStaging(client, prefix=unique_name)


def test_layout_is_one_zset_per_shard_scored_in_epoch_seconds(
    staging: RedisStaging, client: redis.Redis, unique_name: str
) -> None:
    job = uuid.uuid4()
    staging.add(7, [(job, NOW)])
    key = "{" + unique_name + ":7}:staging"
    assert staging.key(7) == key
    assert client.type(key) == b"zset"
    assert client.zrange(key, 0, -1, withscores=True) == [(job.hex.encode(), NOW.timestamp())]


def test_small_chunks_split_commands_and_round_trips(
    staging: RedisStaging, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging_redis, "CHUNK", 7)
    monkeypatch.setattr(staging_redis, "PIPELINE_CHUNKS", 2)
    jobs = [uuid.uuid4() for _ in range(100)]
    items = [(j, NOW + dt.timedelta(seconds=i)) for i, j in enumerate(jobs)]
    # Ids repeated in later chunks and round trips count once, latest score wins.
    assert staging.add(0, items + items[:30]) == 100
    assert staging.add(0, [(jobs[0], NOW + dt.timedelta(seconds=500))]) == 0
    assert staging.remove(0, jobs[50:] + jobs[60:70]) == 50
    assert staging.size(0) == 50
    assert staging.pop_due(0, NOW + dt.timedelta(seconds=1000), 1000) == jobs[1:50] + jobs[:1]


@pytest.mark.parametrize("protocol", [2, 3])
def test_works_with_decoded_responses_and_resp3(
    redis_url: str, unique_name: str, protocol: int
) -> None:
    conn = redis.Redis.from_url(redis_url, decode_responses=True, protocol=protocol)
    try:
        staging = RedisStaging(conn, prefix=unique_name)
        a, b = uuid.uuid4(), uuid.uuid4()
        assert staging.add(0, [(a, NOW), (b, NOW + dt.timedelta(seconds=1.5))]) == 2
        assert staging.next_due(0) == NOW
        assert staging.pop_due(0, NOW, 10) == [a]
        assert staging.next_due(0) == NOW + dt.timedelta(seconds=1.5)
        assert staging.size(0) == 1
    finally:
        conn.delete(staging.key(0))
        conn.close()


def test_concurrent_pops_are_disjoint_and_complete(redis_url: str, unique_name: str) -> None:
    jobs = {uuid.uuid4() for _ in range(20_000)}
    setup = redis.Redis.from_url(redis_url)
    try:
        RedisStaging(setup, prefix=unique_name).add(
            0, [(j, NOW - dt.timedelta(milliseconds=i)) for i, j in enumerate(jobs)]
        )
        results: list[list[uuid.UUID]] = [[], []]
        errors: list[BaseException] = []
        barrier = threading.Barrier(2)

        def popper(slot: int) -> None:
            # Its own client per thread, so the two pops really interleave on
            # two connections rather than queueing on one.
            conn = redis.Redis.from_url(redis_url)
            try:
                staging = RedisStaging(conn, prefix=unique_name)
                barrier.wait()
                while batch := staging.pop_due(0, NOW, 250):
                    results[slot].extend(batch)
            except BaseException as exc:
                errors.append(exc)
            finally:
                conn.close()

        threads = [threading.Thread(target=popper, args=(slot,)) for slot in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not errors
        first, second = (set(r) for r in results)
        assert len(first) == len(results[0]) and len(second) == len(results[1])
        assert first.isdisjoint(second)
        assert first | second == jobs
        # Both threads got work, so the pops really did race.
        assert first and second
        assert setup.zcard(RedisStaging(setup, prefix=unique_name).key(0)) == 0
    finally:
        delete_keys(setup, unique_name)
        setup.close()


def test_unreachable_redis_raises_staging_unavailable_quickly() -> None:
    # Port 1 refuses connections. redis-py's own retries are turned off so
    # the bound measured is RedisStaging's (2 attempts, 50 ms backoff).
    dead = redis.Redis(
        host="127.0.0.1",
        port=1,
        password="s3cret-pass",
        socket_connect_timeout=1,
        socket_timeout=1,
        retry=Retry(NoBackoff(), 0),
    )
    staging = RedisStaging(dead, prefix="unreachable", attempts=2, backoff=0.05)
    calls: list[Callable[[], object]] = [
        lambda: staging.add(0, [(uuid.uuid4(), NOW)]),
        lambda: staging.pop_due(0, NOW, 10),
        lambda: staging.next_due(0),
        lambda: staging.remove(0, [uuid.uuid4()]),
        lambda: staging.size(0),
    ]
    for call in calls:
        started = time.monotonic()
        with pytest.raises(StagingUnavailable) as info:
            call()
        assert time.monotonic() - started < 2.0
        assert "127.0.0.1:1" in str(info.value)
        assert "s3cret-pass" not in str(info.value)
        assert isinstance(info.value.__cause__, redis.exceptions.ConnectionError)


def test_retry_logs_a_warning_per_failed_attempt(caplog: pytest.LogCaptureFixture) -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    slept: list[float] = []
    staging = RedisStaging(dead, prefix="unreachable", attempts=3, backoff=0.01, sleep=slept.append)
    with caplog.at_level("WARNING", logger="celery_sched.retry"), pytest.raises(StagingUnavailable):
        staging.size(0)
    assert slept == [0.01, 0.02]
    assert len(caplog.records) == 2


def test_non_transient_redis_error_is_translated(client: redis.Redis, unique_name: str) -> None:
    # A plain string where the ZSET should be: WRONGTYPE is no outage, so it
    # is not retried, but it still must not leak a redis exception.
    slept: list[float] = []
    broken = RedisStaging(client, prefix=unique_name, sleep=slept.append)
    client.set(broken.key(0), "not a zset")
    for call in (
        lambda: broken.pop_due(0, NOW, 10),
        lambda: broken.add(0, [(uuid.uuid4(), NOW)]),
        lambda: broken.size(0),
    ):
        with pytest.raises(StagingUnavailable, match="WRONGTYPE"):
            call()
    assert slept == []


def test_deleted_key_reads_as_empty(staging: RedisStaging, client: redis.Redis) -> None:
    staging.add(0, [(uuid.uuid4(), NOW) for _ in range(5)])
    client.delete(staging.key(0))  # what a FLUSHALL or eviction does to us
    assert staging.pop_due(0, NOW, 10) == []
    assert staging.next_due(0) is None
    assert staging.size(0) == 0
    assert staging.remove(0, [uuid.uuid4()]) == 0
    job = uuid.uuid4()
    assert staging.add(0, [(job, NOW)]) == 1
    assert staging.pop_due(0, NOW, 10) == [job]


def test_pop_survives_a_script_cache_flush(staging: RedisStaging, client: redis.Redis) -> None:
    job = uuid.uuid4()
    staging.add(0, [(job, NOW)])
    # A restarted Redis forgets loaded scripts; redis-py reloads on NOSCRIPT.
    # SCRIPT FLUSH only drops the Lua cache, never data.
    client.script_flush()
    assert staging.pop_due(0, NOW, 10) == [job]


def test_stray_members_are_dropped_not_raised(
    staging: RedisStaging, client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    job = uuid.uuid4()
    staging.add(0, [(job, NOW)])
    client.zadd(staging.key(0), {"not-a-uuid": NOW.timestamp() - 1})
    with caplog.at_level("WARNING", logger="celery_sched.staging.redis"):
        assert staging.pop_due(0, NOW, 10) == [job]
    assert "not a job id" in caplog.text
    assert staging.size(0) == 0


def test_hundred_thousand_ids_add_and_pop_in_batches(staging: RedisStaging) -> None:
    jobs = [uuid.uuid4() for _ in range(100_000)]
    started = time.monotonic()
    items = [(j, NOW + dt.timedelta(microseconds=i)) for i, j in enumerate(jobs)]
    assert staging.add(0, items) == 100_000
    popped: list[uuid.UUID] = []
    while batch := staging.pop_due(0, NOW + dt.timedelta(seconds=1), 1000):
        popped.extend(batch)
    elapsed = time.monotonic() - started
    assert popped == jobs
    # Pipelined, this takes ~1-2 s on a 2-core box; one round trip per id
    # would take well over 5 s.
    assert elapsed < 15, elapsed


def test_drop_legacy_restages_the_ids_of_the_set_before_hash_tags_and_empties_it(
    staging: RedisStaging, client: redis.Redis, unique_name: str
) -> None:
    legacy = legacy_staging_key(unique_name, 0)
    moved, both = uuid.uuid4(), uuid.uuid4()
    client.zadd(
        legacy,
        {moved.hex: NOW.timestamp(), both.hex: NOW.timestamp() + 5, "not-a-job-id": 1.0},
    )
    staging.add(0, [(both, NOW + dt.timedelta(seconds=9))])
    client.zadd(legacy_staging_key(unique_name, 1), {uuid.uuid4().hex: 1.0})

    assert staging.drop_legacy(0) == 2
    assert client.exists(legacy) == 0
    # Both ids are staged under the new key; one staged there already keeps its score.
    assert staging.pop_due(0, NOW, 10) == [moved]
    assert staging.next_due(0) == NOW + dt.timedelta(seconds=9)
    # Another shard's old set is not this call's business.
    assert client.exists(legacy_staging_key(unique_name, 1)) == 1
    assert staging.drop_legacy(0) == 0
