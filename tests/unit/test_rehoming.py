"""Shard 0's rehoming duty and the whole pass of ``sched reshard``, on the
memory store (issue 17)."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from typing import Any

import pytest

from celery_sched.errors import StagingUnavailable, StoreUnavailable
from celery_sched.leader.clock import StoreClock
from celery_sched.leader.rehoming import IN_FLIGHT_INTERVAL, REHOME_BATCHES, Rehoming, reshard
from celery_sched.leader.stats import EngineStats
from celery_sched.models import JobStatus
from celery_sched.settings import Settings
from celery_sched.staging.memory import MemoryStaging
from celery_sched.store.memory import MemoryJobStore
from celery_sched.validation import shard_of_key
from tests.contract.conftest import new_job

SECOND = dt.timedelta(seconds=1)


def duty(
    store: MemoryJobStore, staging: Any, *, shards: int, shard: int = 0, batch: int = 5
) -> tuple[Rehoming, EngineStats]:
    settings = Settings(shards=shards, shard=shard, batch_size=batch, staging_window=3600.0)
    stats = EngineStats()
    rehoming = Rehoming(
        store=store,
        staging=staging,
        settings=settings,
        store_clock=StoreClock(store, time.monotonic),
        stats=stats,
        shard_of=lambda key: shard_of_key(key, shards),
    )
    return rehoming, stats


def written_under(store: MemoryJobStore, shards: int, n: int, *, due_in: float = 5) -> list[str]:
    keys = [f"job-{i}" for i in range(n)]
    now = store.now()
    for i, key in enumerate(keys):
        store.add_job(
            new_job(key, now + dt.timedelta(seconds=due_in + i), shard=shard_of_key(key, shards))
        )
    return keys


def placed(store: MemoryJobStore, keys: list[str], shards: int) -> bool:
    return all(store.get(key).shard == shard_of_key(key, shards) for key in keys)  # type: ignore[union-attr]


def spy_on_rehome(store: MemoryJobStore) -> list[bool]:
    """Record ``stranded_only`` of every ``store.rehome`` call from now on."""
    calls: list[bool] = []
    original = store.rehome

    def spy(**kwargs: Any) -> Any:
        calls.append(kwargs["stranded_only"])
        return original(**kwargs)

    store.rehome = spy  # type: ignore[method-assign]
    return calls


def test_shard_0_moves_stranded_rows_then_makes_one_full_pass_and_records_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, staging = MemoryJobStore(), MemoryStaging()
    keys = written_under(store, 4, 40)
    store.record_placement(4)
    rehoming, stats = duty(store, staging, shards=2, batch=5)
    with caplog.at_level(logging.INFO, logger="celery_sched.leader.rehoming"):
        while rehoming.run():
            pass
    assert placed(store, keys, 2)
    assert store.placed_for() == 2
    moved = sum(1 for key in keys if shard_of_key(key, 4) != shard_of_key(key, 2))
    assert stats.rehomed == moved > 0
    assert any("stranded in shards >= 2" in r.getMessage() for r in caplog.records)
    # Moved pending rows due within the window are staged for their new shard.
    staged = staging.size(0) + staging.size(1)
    assert staged == moved
    # Recorded: the next passes read no page (only the stranded probe).
    calls = spy_on_rehome(store)
    assert rehoming.run() is False
    assert calls == [True]


def test_a_raised_count_moves_rows_by_the_full_pass_in_bounded_passes() -> None:
    store, staging = MemoryJobStore(), MemoryStaging()
    keys = written_under(store, 1, 2 * REHOME_BATCHES * 3)
    store.record_placement(1)
    rehoming, _ = duty(store, staging, shards=4, batch=3)
    assert rehoming.run() is True  # bounded: REHOME_BATCHES pages, more left
    assert store.placed_for() == 1 and not placed(store, keys, 4)
    passes = 1
    while rehoming.run():
        passes += 1
    assert passes == 2
    assert placed(store, keys, 4) and store.placed_for() == 4


def test_only_shard_0_rehomes() -> None:
    store = MemoryJobStore()
    keys = written_under(store, 4, 10)
    rehoming, _ = duty(store, MemoryStaging(), shards=2, shard=1)
    assert rehoming.run() is False
    assert placed(store, keys, 4) and store.placed_for() is None


def test_a_failed_batch_moves_nothing_and_the_next_pass_goes_on() -> None:
    store = MemoryJobStore()
    keys = written_under(store, 4, 12)
    rehoming, _ = duty(store, MemoryStaging(), shards=2, batch=2)
    original = store.rehome
    failures = iter([StoreUnavailable("down")])

    def flaky(**kwargs: Any) -> Any:
        for exc in failures:
            raise exc
        return original(**kwargs)

    store.rehome = flaky  # type: ignore[method-assign]
    with pytest.raises(StoreUnavailable):
        rehoming.run()
    assert placed(store, keys, 4)
    while rehoming.run():
        pass
    assert placed(store, keys, 2) and store.placed_for() == 2


def test_staging_down_only_slows_the_moved_rows() -> None:
    class DownStaging(MemoryStaging):
        def add(self, shard: int, items: Any) -> int:
            raise StagingUnavailable("redis down")

    store = MemoryJobStore()
    keys = written_under(store, 4, 10)
    rehoming, _ = duty(store, DownStaging(), shards=2)
    while rehoming.run():
        pass
    assert placed(store, keys, 2)


def test_far_future_and_in_flight_rows_move_but_are_not_staged() -> None:
    store, staging = MemoryJobStore(), MemoryStaging()
    now = store.now()
    key = next(k for k in (f"k{i}" for i in range(100)) if shard_of_key(k, 1) == 0)
    store.add_job(new_job("far", now + dt.timedelta(days=1), shard=3))
    store.add_job(new_job(key, now - SECOND, shard=3))
    epoch = store.acquire_epoch(3, "old")
    [claimed] = store.claim_due(shard=3, epoch=epoch, limit=1)
    rehoming, _ = duty(store, staging, shards=1)
    while rehoming.run():
        pass
    assert store.get("far").shard == 0  # type: ignore[union-attr]
    assert store.get(key).shard == 0 and store.get(key).status is JobStatus.DISPATCHED  # type: ignore[union-attr]
    assert staging.size(0) == 0
    assert claimed.key == key


def test_reshard_dry_run_counts_and_moves_nothing_then_the_real_pass_moves_all() -> None:
    store = MemoryJobStore()
    keys = written_under(store, 4, 30)
    keyless = uuid.uuid4()
    store.add_job(new_job(str(keyless), store.now() + SECOND, id=keyless, shard=3))
    expected = sum(1 for key in keys if shard_of_key(key, 4) != shard_of_key(key, 2))
    expected += shard_of_key(str(keyless), 2) != 3
    seen: list[int] = []
    dry = reshard(
        store,
        shards=2,
        shard_of=lambda k: shard_of_key(k, 2),
        batch=7,
        dry_run=True,
        on_batch=lambda result: seen.append(result.scanned),
    )
    assert (dry.scanned, dry.moved) == (31, expected) and sum(seen) == 31
    assert placed(store, keys, 4) and store.placed_for() is None
    done = reshard(store, shards=2, shard_of=lambda k: shard_of_key(k, 2), batch=7)
    assert done.moved == expected
    assert sum(done.by_shards.values()) == expected
    assert all(target < 2 for _, target in done.by_shards)
    assert placed(store, keys, 2) and store.placed_for() == 2


def dispatched_in(store: MemoryJobStore, key: str, shard: int) -> None:
    """A job of ``key`` in ``shard``, claimed there (in flight)."""
    store.add_job(new_job(key, store.now() - SECOND, shard=shard))
    epoch = store.acquire_epoch(shard, f"leader-{key}")
    [claimed] = store.claim_due(shard=shard, epoch=epoch, limit=1)
    assert claimed.key == key


def test_stranded_jobs_in_flight_are_looked_for_every_30_seconds() -> None:
    store, staging = MemoryJobStore(), MemoryStaging()
    store.record_placement(1)
    now = [0.0]
    settings = Settings(shards=1, shard=0, batch_size=5)
    rehoming = Rehoming(
        store=store,
        staging=staging,
        settings=settings,
        store_clock=StoreClock(store, time.monotonic),
        stats=EngineStats(),
        shard_of=lambda key: shard_of_key(key, 1),
        clock=lambda: now[0],
    )
    dispatched_in(store, "first", 2)
    assert rehoming.run() is False
    assert store.get("first").shard == 0  # type: ignore[union-attr]
    # Pending stranded rows move on every pass; those in flight wait for their look.
    dispatched_in(store, "second", 3)
    store.add_job(new_job("waiting", store.now() + dt.timedelta(hours=1), shard=3))
    now[0] = IN_FLIGHT_INTERVAL - 1
    rehoming.run()
    assert store.get("waiting").shard == 0  # type: ignore[union-attr]
    assert store.get("second").shard == 3  # type: ignore[union-attr]
    now[0] = IN_FLIGHT_INTERVAL
    rehoming.run()
    assert store.get("second").shard == 0  # type: ignore[union-attr]
    assert store.get("second").status is JobStatus.DISPATCHED  # type: ignore[union-attr]


def test_one_shard_records_its_placement_without_walking_every_row() -> None:
    store, staging = MemoryJobStore(), MemoryStaging()
    keys = written_under(store, 1, 12)
    store.add_job(new_job("stranded", store.now() + SECOND, shard=2))
    dispatched_in(store, "flying", 3)
    assert store.placed_for() is None  # as after the upgrade to 0009
    calls = spy_on_rehome(store)
    rehoming, _ = duty(store, staging, shards=1, batch=5)
    while rehoming.run():
        pass
    assert store.placed_for() == 1
    assert placed(store, [*keys, "stranded", "flying"], 1)
    assert calls and all(calls), "a one-shard store needs no full pass over every row"
