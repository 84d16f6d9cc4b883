"""The JobStore contract of listing and requeueing by hand (``sched jobs``,
``sched dead``, ``sched requeue``): every backend (memory, postgres) must pass it."""

from __future__ import annotations

import datetime as dt
import time
import uuid

import pytest

from celery_sched.interfaces import JobStore
from celery_sched.models import Job, JobQuery, JobStatus, PageCursor
from celery_sched.timeutil import to_bucket
from tests.contract.conftest import new_job, tracked

MINUTE = dt.timedelta(minutes=1)


def base(store: JobStore) -> dt.datetime:
    return (store.now() + dt.timedelta(days=3)).replace(microsecond=0)


def walk(store: JobStore, query: JobQuery, limit: int) -> list[list[str]]:
    """Every page of ``query``, ``limit`` jobs a page, as lists of keys."""
    pages: list[list[str]] = []
    after: PageCursor | None = None
    while True:
        jobs = store.list_jobs(query, after=after, limit=limit)
        if not jobs:
            return pages
        pages.append([job.key for job in jobs])
        after = PageCursor.of(jobs[-1])
        assert len(pages) < 100, "paging does not end"


def kill(store: JobStore, key: str, *, shard: int = 0) -> Job:
    """Insert an overdue job with ``max_attempts`` 1 and let the reconciler
    give up on it (dispatched, never started): it is dead at attempt 1."""
    store.add_job(new_job(key, store.now() - 5 * MINUTE, max_attempts=1, shard=shard))
    epoch = store.acquire_epoch(shard, "test")
    assert [job.key for job in store.claim_due(shard=shard, epoch=epoch, limit=100)] == [key]
    tracked(store)
    store.reconcile(shard=shard, epoch=epoch, limit=100, default_visibility_timeout=0.0)
    job = store.get(key)
    assert job is not None and job.status is JobStatus.DEAD and job.attempt == 1
    return job


# -- listing ---------------------------------------------------------------------------


def test_pages_walk_every_pending_job_once_in_due_order_across_shards(store: JobStore) -> None:
    start = base(store)
    # Two jobs share each due time (ties are ordered by id), spread over three shards.
    jobs = [
        new_job(f"j{i:02d}", start + (i // 2) * MINUTE, shard=i % 3, id=uuid.UUID(int=i + 1))
        for i in range(23)
    ]
    store.load_jobs(jobs)
    expected = [job.key for job in sorted(jobs, key=lambda job: (job.due_at, job.id.bytes))]
    for statuses in (frozenset({JobStatus.PENDING}), frozenset()):
        pages = walk(store, JobQuery(statuses=statuses), limit=5)
        assert [len(page) for page in pages] == [5, 5, 5, 5, 3]
        assert [key for page in pages for key in page] == expected
        newest = walk(store, JobQuery(statuses=statuses, newest=True), limit=4)
        assert [key for page in newest for key in page] == expected[::-1]


def test_filters_narrow_the_listing(store: JobStore) -> None:
    start = base(store)
    store.load_jobs(
        [
            new_job("nightly@2031-01-01", start, task="t.a"),
            new_job("nightly@2031-01-02", start + MINUTE, task="t.b"),
            new_job("nightlyx", start + 2 * MINUTE, task="t.a"),
            new_job("other", start + 3 * MINUTE, task="t.a"),
        ]
    )
    assert store.cancel("other")

    def keys(**fields: object) -> list[str]:
        return [job.key for job in store.list_jobs(JobQuery(**fields), limit=50)]  # type: ignore[arg-type]

    assert keys(key_prefix="nightly@") == ["nightly@2031-01-01", "nightly@2031-01-02"]
    assert keys(key_prefix="nightly") == ["nightly@2031-01-01", "nightly@2031-01-02", "nightlyx"]
    assert keys(task="t.a") == ["nightly@2031-01-01", "nightlyx", "other"]
    assert keys(statuses={JobStatus.CANCELLED}) == ["other"]
    assert keys(statuses={JobStatus.PENDING}, task="t.a") == ["nightly@2031-01-01", "nightlyx"]
    assert keys(statuses={JobStatus.PENDING, JobStatus.CANCELLED}, key_prefix="o") == ["other"]
    # Half-open: due_after inclusive, due_before exclusive.
    assert keys(due_after=start + MINUTE, due_before=start + 3 * MINUTE) == [
        "nightly@2031-01-02",
        "nightlyx",
    ]
    assert keys(statuses={JobStatus.PENDING}, due_after=start + 2 * MINUTE) == ["nightlyx"]
    assert keys(statuses={JobStatus.PENDING}, due_before=start + MINUTE) == ["nightly@2031-01-01"]
    assert keys(key_prefix="nothing") == []
    assert keys(statuses={JobStatus.DEAD}) == []


def test_a_keyless_job_is_found_by_a_prefix_of_its_id(store: JobStore) -> None:
    job_id = uuid.UUID("0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b")
    store.add_job(new_job(str(job_id), base(store), id=job_id))
    store.add_job(new_job("0190-not-an-id", base(store)))
    found = [job.key for job in store.list_jobs(JobQuery(key_prefix="0190a1b2-c3"), limit=10)]
    assert found == [str(job_id)]
    found = [job.key for job in store.list_jobs(JobQuery(key_prefix="0190"), limit=10)]
    assert sorted(found) == sorted([str(job_id), "0190-not-an-id"])


def test_a_page_after_a_cursor_with_filters_and_newest(store: JobStore) -> None:
    start = base(store)
    store.load_jobs([new_job(f"k{i}", start + i * MINUTE, shard=i % 2) for i in range(10)])
    query = JobQuery(statuses={JobStatus.PENDING}, due_before=start + 8 * MINUTE, newest=True)
    first = store.list_jobs(query, limit=3)
    assert [job.key for job in first] == ["k7", "k6", "k5"]
    rest = store.list_jobs(query, after=PageCursor.of(first[-1]), limit=10)
    assert [job.key for job in rest] == ["k4", "k3", "k2", "k1", "k0"]


def test_cursor_round_trips_and_refuses_garbage() -> None:
    from celery_sched.errors import InvalidCursor

    cursor = PageCursor(
        due_at=dt.datetime(2031, 5, 1, 10, 0, 0, 123456, tzinfo=dt.UTC), id=uuid.uuid4()
    )
    assert PageCursor.decode(cursor.encode()) == cursor
    for bad in ("", "x", "not a cursor!", cursor.encode()[:-2], cursor.encode() + "AA"):
        with pytest.raises(InvalidCursor):
            PageCursor.decode(bad)


# -- requeue ---------------------------------------------------------------------------


def test_requeue_moves_dead_and_failed_jobs_on_and_reports_the_others(store: JobStore) -> None:
    dead = kill(store, "dead")
    store.add_job(new_job("failed", store.now() - MINUTE, max_attempts=3))
    failed = store.get("failed")
    assert failed is not None
    assert store.mark_finished(failed.id, JobStatus.FAILED, error="boom")
    store.add_job(new_job("pending", base(store)))
    before = store.now()

    result = store.requeue(["dead", "failed", "pending", "ghost", "dead"])

    assert sorted(job.key for job in result.requeued) == ["dead", "failed"]
    assert result.refused == {"pending": JobStatus.PENDING}
    assert result.unknown == ["ghost"]
    again = store.get("dead")
    assert again is not None and again in result.requeued
    assert again.status is JobStatus.PENDING
    # Attempt moves on (never back), with a fresh allowance of max_attempts.
    assert (again.attempt, again.max_attempts) == (2, 2 + 1)
    assert abs(again.due_at - before) < dt.timedelta(seconds=30)
    assert again.due_bucket == to_bucket(again.due_at)
    assert again.finished_at is None and again.dispatched_at is None
    assert again.started_at is None
    # The history is kept.
    assert again.last_error == dead.last_error and again.last_error
    assert again.leader_epoch == dead.leader_epoch
    refailed = store.get("failed")
    assert refailed is not None and refailed.status is JobStatus.PENDING
    assert (refailed.attempt, refailed.max_attempts, refailed.last_error) == (1, 4, "boom")
    # Requeued jobs are claimable now.
    epoch = store.acquire_epoch(0, "next")
    claimed = {job.key for job in store.claim_due(shard=0, epoch=epoch, limit=10)}
    assert claimed == {"dead", "failed"}
    # A second requeue of a job now dispatched is refused, nothing changes.
    assert store.requeue(["dead"]).refused == {"dead": JobStatus.DISPATCHED}


def test_requeue_with_an_allowance_and_by_id_key(store: JobStore) -> None:
    job_id = uuid.uuid4()
    store.add_job(new_job(str(job_id), store.now() - MINUTE, id=job_id))
    assert store.mark_finished(job_id, JobStatus.FAILED, error="x")
    result = store.requeue([str(job_id)], allowance=7)
    assert [(job.key, job.attempt, job.max_attempts) for job in result.requeued] == [
        (str(job_id), 1, 8)
    ]
    with pytest.raises(ValueError, match="at least one attempt"):
        store.requeue([str(job_id)], allowance=0)


def test_requeue_dead_takes_batches_of_dead_jobs_only_and_only_those_dead_by_then(
    store: JobStore,
) -> None:
    for i in range(5):
        kill(store, f"dead{i}", shard=i % 2)
    store.add_job(new_job("alive", base(store)))
    died_by = store.now()
    first = store.requeue_dead(died_by=died_by, limit=2)
    second = store.requeue_dead(died_by=died_by, task="tests.add", limit=2)
    third = store.requeue_dead(died_by=died_by, limit=2)
    assert [len(first), len(second), len(third)] == [2, 2, 1]
    assert sorted(job.key for job in first + second + third) == [f"dead{i}" for i in range(5)]
    assert store.requeue_dead(died_by=died_by, limit=2) == []
    assert store.counts_by_status() == {JobStatus.PENDING: 6}
    assert all(job.attempt == 2 and job.max_attempts == 3 for job in first + second + third)

    kill(store, "late", shard=7)
    # Died after died_by, or of another task: left dead.
    assert store.requeue_dead(died_by=died_by, limit=10) == []
    assert store.requeue_dead(died_by=store.now(), task="other.task", limit=10) == []
    assert [job.key for job in store.requeue_dead(died_by=store.now(), limit=10)] == ["late"]


def test_dead_jobs_list_in_due_order(store: JobStore) -> None:
    for i in range(4):
        kill(store, f"d{i}")
    query = JobQuery(statuses={JobStatus.DEAD})
    pages = walk(store, query, limit=3)
    listed = [key for page in pages for key in page]
    jobs = [store.get(key) for key in listed]
    assert sorted(listed) == [f"d{i}" for i in range(4)]
    assert all(job is not None for job in jobs)
    order = [(job.due_at, job.id.bytes) for job in jobs if job is not None]
    assert order == sorted(order)


# -- the web console's overview -------------------------------------------------------


def test_dispatches_by_minute_counts_sent_jobs_per_due_minute_with_their_mean_lag(
    store: JobStore,
) -> None:
    now = store.now()
    minute = (now - 10 * MINUTE).replace(second=0, microsecond=0)
    later = minute + 2 * MINUTE
    sent = {
        "a": minute + dt.timedelta(seconds=5),
        "b": minute + dt.timedelta(seconds=40),
        "c": later + dt.timedelta(seconds=1),
    }
    for key, due in sent.items():
        store.add_job(new_job(key, due))
    epoch = store.acquire_epoch(0, "test")
    claimed = store.claim_due(shard=0, epoch=epoch, limit=100)
    assert sorted(job.key for job in claimed) == ["a", "b", "c"]
    dispatched_at = {job.key: job.dispatched_at for job in claimed}
    # Not dispatched (pending, future; cancelled) or outside the window: not counted.
    store.add_job(new_job("pending", store.now() + 5 * MINUTE))
    store.add_job(new_job("cancelled", store.now() + 6 * MINUTE))
    store.cancel("cancelled")

    found = store.dispatches_by_minute(since=minute, until=now + 10 * MINUTE)

    assert sorted(found) == [minute, later]
    for at in found:
        assert at.utcoffset() == dt.timedelta(0)
    assert found[minute].count == 2 and found[later].count == 1

    def lag(key: str) -> float:
        sent_at = dispatched_at[key]
        assert sent_at is not None
        return (sent_at - sent[key]).total_seconds()

    assert found[minute].mean_lag == pytest.approx((lag("a") + lag("b")) / 2, abs=1e-3)
    assert found[later].mean_lag == pytest.approx(lag("c"), abs=1e-3)
    # The window is half-open and filters by due time.
    assert sorted(store.dispatches_by_minute(since=minute, until=later)) == [minute]
    assert store.dispatches_by_minute(since=later + MINUTE, until=now) == {}


def test_recent_failures_are_failed_and_dead_jobs_the_latest_finished_first(
    store: JobStore,
) -> None:
    start = store.now() - 30 * MINUTE  # due already, as jobs a worker ran are
    # Due order is the opposite of the order they fail in; shard 1, so
    # that kill() claims on shard 0 only its own job.
    for i, key in enumerate(["f3", "f2", "f1"]):
        store.add_job(new_job(key, start - i * MINUTE, shard=1))
    store.add_job(new_job("ok", start, shard=1))
    for key in ["f1", "f2"]:
        job = store.get(key)
        assert job is not None
        assert store.mark_running(job.id, worker="w") is True
        assert store.mark_finished(job.id, JobStatus.FAILED) is True
        time.sleep(0.01)  # finished_at tells them apart on any clock
    kill(store, "d1")
    time.sleep(0.01)
    job = store.get("f3")
    assert job is not None and store.mark_running(job.id, worker="w")
    assert store.mark_finished(job.id, JobStatus.FAILED) is True
    ok = store.get("ok")
    assert ok is not None and store.mark_running(ok.id, worker="w")
    assert store.mark_finished(ok.id, JobStatus.SUCCEEDED) is True

    assert [job.key for job in store.recent_failures(limit=10)] == ["f3", "d1", "f2", "f1"]
    assert [job.key for job in store.recent_failures(limit=2)] == ["f3", "d1"]
    assert store.recent_failures(limit=0) == []
