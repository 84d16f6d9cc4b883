"""The Jobs.rehome contract (issue 17): rows moved to the shard their key
hashes to when the shard count changes, on every backend (memory, postgres)."""

from __future__ import annotations

import datetime as dt
import uuid
import zlib

import pytest

from celery_sched.interfaces import JobStore
from celery_sched.models import DueSpan, JobStatus
from tests.contract.conftest import new_job

SECOND = dt.timedelta(seconds=1)


def hashed(shards: int):  # type: ignore[no-untyped-def]
    """The client's shard_of for ``shards`` shards."""
    return lambda key: zlib.crc32(key.encode()) % shards


def shard_of_key(store: JobStore, key: str) -> int:
    job = store.get(key)
    assert job is not None, key
    return job.shard


def test_a_stranded_only_batch_moves_rows_above_the_count_soonest_due_first(
    store: JobStore,
) -> None:
    now = store.now()
    # Written under 4 shards; the count is now 2.
    for i in range(6):
        key = f"k{i}"
        store.add_job(new_job(key, now + (6 - i) * SECOND, shard=hashed(4)(key)))
    stranded = {f"k{i}" for i in range(6) if hashed(4)(f"k{i}") >= 2}
    assert stranded, "the keys must put some rows in shards 2..3"
    result = store.rehome(shards=2, shard_of=hashed(2), limit=1, stranded_only=True)
    assert result.scanned == 1 and result.after is None
    [moved] = result.moved
    # The soonest due stranded row went first: k5 is due soonest, then k4...
    soonest = max(stranded, key=lambda key: int(key[1:]))
    assert store.get_by_id(moved.id).key == soonest  # type: ignore[union-attr]
    assert (moved.from_shard, moved.to_shard) == (hashed(4)(soonest), hashed(2)(soonest))
    assert moved.status is JobStatus.PENDING
    while store.rehome(shards=2, shard_of=hashed(2), limit=2, stranded_only=True).moved:
        pass
    for i in range(6):
        key = f"k{i}"
        expected = hashed(2)(key) if key in stranded else hashed(4)(key)
        assert shard_of_key(store, key) == expected, key
    assert store.unfinished_by_shard(from_shard=2) == {}


def test_a_full_pass_pages_by_id_and_moves_only_misplaced_unfinished_rows(
    store: JobStore,
) -> None:
    now = store.now()
    keys = [f"job-{i}" for i in range(25)]
    for key in keys:
        store.add_job(new_job(key, now + SECOND, shard=0))  # written under 1 shard
    # A finished row stays where it is, misplaced or not.
    store.add_job(new_job("done", now + SECOND, shard=0))
    assert store.cancel("done")
    scanned, moved, after, pages = 0, 0, None, 0
    while True:
        result = store.rehome(
            shards=4, shard_of=hashed(4), limit=10, stranded_only=False, after=after
        )
        scanned += result.scanned
        moved += len(result.moved)
        pages += 1
        after = result.after
        if after is None:
            break
    assert scanned == 25 and pages == 3
    assert moved == sum(1 for key in keys if hashed(4)(key) != 0) > 0
    for key in keys:
        assert shard_of_key(store, key) == hashed(4)(key), key
    assert shard_of_key(store, "done") == 0
    # A second pass finds nothing to move.
    again = store.rehome(shards=4, shard_of=hashed(4), limit=100, stranded_only=False)
    assert again.scanned == 25 and again.moved == () and again.after is None


def test_a_keyless_job_is_placed_by_its_id_text(store: JobStore) -> None:
    now = store.now()
    job_id = uuid.uuid4()
    # A job scheduled without a key: its key is its id's text.
    store.add_job(new_job(str(job_id), now + SECOND, id=job_id, shard=0))
    result = store.rehome(shards=7, shard_of=hashed(7), limit=10, stranded_only=False)
    target = hashed(7)(str(job_id))
    assert [(m.id, m.to_shard) for m in result.moved] == ([] if target == 0 else [(job_id, target)])
    assert store.get_by_id(job_id).shard == target  # type: ignore[union-attr]


def test_in_flight_rows_move_too_and_a_dry_run_moves_nothing(store: JobStore) -> None:
    now = store.now()
    store.add_job(new_job("flying", now - SECOND, shard=3))
    epoch = store.acquire_epoch(3, "old fleet")
    [claimed] = store.claim_due(shard=3, epoch=epoch, limit=1)
    store.add_job(new_job("waiting", now + SECOND, shard=3))
    dry = store.rehome(shards=1, shard_of=hashed(1), limit=10, stranded_only=True, dry_run=True)
    assert {(m.status, m.to_shard) for m in dry.moved} == {
        (JobStatus.PENDING, 0),
        (JobStatus.DISPATCHED, 0),
    }
    assert dry.moved[0].status is JobStatus.PENDING  # pending first
    assert shard_of_key(store, "flying") == 3 and shard_of_key(store, "waiting") == 3
    done = store.rehome(shards=1, shard_of=hashed(1), limit=10, stranded_only=True)
    assert len(done.moved) == 2
    # The old leader's fenced transitions still apply to the row it claimed
    # (they go by id and epoch); the new shard's reconciler owns it now.
    assert store.release([claimed.id], epoch=epoch, due=DueSpan.of([claimed.due_at])) == 1
    new_epoch = store.acquire_epoch(0, "new fleet")
    assert [job.key for job in store.claim_due(shard=0, epoch=new_epoch, limit=5)] == ["flying"]


def test_without_in_flight_only_pending_stranded_rows_move(store: JobStore) -> None:
    now = store.now()
    store.add_job(new_job("flying", now - SECOND, shard=3))
    epoch = store.acquire_epoch(3, "old fleet")
    store.claim_due(shard=3, epoch=epoch, limit=1)
    store.add_job(new_job("waiting", now + SECOND, shard=3))
    result = store.rehome(
        shards=1, shard_of=hashed(1), limit=10, stranded_only=True, in_flight=False
    )
    assert [(m.status, m.to_shard) for m in result.moved] == [(JobStatus.PENDING, 0)]
    assert shard_of_key(store, "waiting") == 0 and shard_of_key(store, "flying") == 3
    result = store.rehome(shards=1, shard_of=hashed(1), limit=10, stranded_only=True)
    assert [(m.status, m.to_shard) for m in result.moved] == [(JobStatus.DISPATCHED, 0)]


def test_the_placement_is_recorded(store: JobStore) -> None:
    assert store.placed_for() is None
    store.record_placement(4)
    assert store.placed_for() == 4
    store.record_placement(2)
    assert store.placed_for() == 2


@pytest.mark.parametrize(("shards", "limit"), [(0, 10), (2, 0)])
def test_bad_arguments_are_refused(store: JobStore, shards: int, limit: int) -> None:
    with pytest.raises(ValueError):
        store.rehome(shards=shards, shard_of=hashed(2), limit=limit, stranded_only=False)


def test_a_shard_of_outside_the_count_is_refused_and_moves_nothing(store: JobStore) -> None:
    store.add_job(new_job("x", store.now() + SECOND, shard=5))
    with pytest.raises(ValueError, match="outside"):
        store.rehome(shards=2, shard_of=lambda key: 9, limit=10, stranded_only=True)
    assert shard_of_key(store, "x") == 5
