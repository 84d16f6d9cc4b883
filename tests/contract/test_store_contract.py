"""The JobStore contract: every backend (memory, postgres) must pass all of it."""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator

import pytest

from celery_sched.errors import DuplicateJob, StaleEpoch
from celery_sched.interfaces import JobStore
from celery_sched.models import (
    SENT_DUE_MARGIN,
    DueSpan,
    Job,
    JobStatus,
    NewJob,
    WorkerUpdate,
    election_count,
)
from celery_sched.timeutil import to_bucket
from tests.contract.conftest import due_of, new_job, tracked

SECOND = dt.timedelta(seconds=1)
HOUR = dt.timedelta(hours=1)


def past(store: JobStore, seconds: float) -> dt.datetime:
    return store.now() - dt.timedelta(seconds=seconds)


def future(store: JobStore, seconds: float = 3 * 86400) -> dt.datetime:
    return store.now() + dt.timedelta(seconds=seconds)


def status_of(store: JobStore, key: str) -> JobStatus:
    job = store.get(key)
    assert job is not None, key
    return job.status


def leader(store: JobStore, shard: int = 0) -> int:
    return store.acquire_epoch(shard, f"test-holder-{shard}")


def claim_one(store: JobStore, key: str, **fields: object) -> tuple[Job, int]:
    """Insert an overdue job and claim it; return the claimed job and the epoch."""
    store.add_job(new_job(key, past(store, 5), **fields))
    epoch = leader(store)
    claimed = store.claim_due(shard=0, epoch=epoch, limit=10)
    assert [job.key for job in claimed] == [key]
    return claimed[0], epoch


# -- lifecycle ---------------------------------------------------------------


def test_now_is_aware_utc_and_current(store: JobStore) -> None:
    now = store.now()
    assert now.utcoffset() == dt.timedelta(0)
    assert abs(now - dt.datetime.now(dt.UTC)) < dt.timedelta(seconds=30)


def test_migrate_is_idempotent(store: JobStore) -> None:
    store.add_job(new_job("kept", future(store)))
    store.migrate()
    assert store.get("kept") is not None


# -- insert --------------------------------------------------------------------


def test_insert_stores_every_field(store: JobStore) -> None:
    due = future(store, 3600).replace(microsecond=123456)
    expires = due + HOUR
    job = new_job(
        "full",
        due,
        expires_at=expires,
        max_attempts=3,
        shard=2,
        schedule_id=42,
        visibility_timeout=12.5,
        max_runtime=60.0,
    )
    stored = store.add_job(job)
    assert stored.id == job.id
    assert stored.status is JobStatus.PENDING
    assert stored.due_at == due
    assert stored.due_bucket == to_bucket(due)
    assert stored.expires_at == expires
    assert stored.body == job.body
    assert stored.args == (1, 2)
    assert stored.kwargs == {"flag": True}
    assert dict(stored.options) == {"queue": "celery", "priority": 3, "headers": {"h": "v"}}
    assert (stored.max_attempts, stored.shard, stored.schedule_id) == (3, 2, 42)
    assert (stored.visibility_timeout, stored.max_runtime) == (12.5, 60.0)
    assert stored.attempt == 0
    assert stored.created_at is not None
    assert stored.dispatched_at is None and stored.finished_at is None
    assert store.get("full") == stored
    assert store.get_by_id(job.id) == stored


def test_get_unknown_returns_none(store: JobStore) -> None:
    assert store.get("nope") is None
    assert store.get_by_id(uuid.uuid4()) is None


def test_insert_duplicate_key_raises(store: JobStore) -> None:
    store.add_job(new_job("dup", future(store)))
    with pytest.raises(DuplicateJob) as info:
        store.add_job(new_job("dup", future(store, 60)))
    assert info.value.key == "dup"
    assert store.counts_by_status() == {JobStatus.PENDING: 1}


def test_insert_duplicate_key_can_return_existing(store: JobStore) -> None:
    first = store.add_job(new_job("same", future(store)))
    second = store.add_job(new_job("same", future(store, 60)), if_exists="return")
    assert second == first
    assert store.counts_by_status() == {JobStatus.PENDING: 1}


def id_keyed(due_at: dt.datetime) -> NewJob:
    """A job whose key is its id's text, as for every job scheduled without a key."""
    job_id = uuid.uuid4()
    return new_job(str(job_id), due_at, id=job_id)


def test_a_key_that_is_the_id_reads_back_claims_and_cancels_by_that_key(store: JobStore) -> None:
    single, bulk, gone = id_keyed(past(store, 5)), id_keyed(past(store, 4)), id_keyed(future(store))
    assert store.add_job(single).key == single.key
    # The bulk path's rows leave such a key out (None); it reads back as the id's text.
    assert store.load_job_rows([(bulk.as_row()[0], None, *bulk.as_row()[2:])]) == 1
    assert store.load_jobs([gone]) == 1
    for job in (single, bulk, gone):
        stored = store.get(job.key)
        assert stored is not None
        assert (stored.id, stored.key) == (job.id, str(job.id))
        by_id = store.get_by_id(job.id)
        assert by_id is not None and by_id.key == job.key
    claimed = store.claim_due(shard=0, epoch=leader(store), limit=10)
    assert [(job.id, job.key) for job in claimed] == [(single.id, single.key), (bulk.id, bulk.key)]
    assert store.cancel(gone.key) is True
    assert status_of(store, gone.key) is JobStatus.CANCELLED


def test_a_key_that_is_the_id_is_unique_with_the_id(store: JobStore) -> None:
    first = id_keyed(future(store))
    store.add_job(first)
    again = new_job(first.key, future(store, 60), id=first.id)
    with pytest.raises(DuplicateJob) as info:
        store.add_job(again)
    assert info.value.key == first.key
    assert store.add_job(again, if_exists="return") == store.get(first.key)
    with pytest.raises(DuplicateJob):
        store.load_job_rows([(first.id, None, *again.as_row()[2:])])
    assert store.counts_by_status() == {JobStatus.PENDING: 1}


def test_a_uuid_text_key_must_be_the_jobs_id(store: JobStore) -> None:
    """Such a key is kept as the id, so no job may pair it with another id; a
    key that is not a UUID's canonical text is an ordinary key."""
    other = store.add_job(new_job("k", future(store)))
    with pytest.raises(ValueError, match="must be the job's id"):
        new_job(str(other.id), future(store, 60))
    upper = store.add_job(new_job(str(other.id).upper(), future(store, 60)))
    assert upper.id != other.id and upper.key == str(other.id).upper()
    assert store.get(str(other.id)) is None
    found = store.get(str(other.id).upper())
    assert found is not None and found.id == upper.id
    assert store.cancel(str(other.id)) is False
    assert status_of(store, "k") is JobStatus.PENDING


# -- load_jobs -----------------------------------------------------------------


def test_insert_many_writes_all_from_a_generator(store: JobStore) -> None:
    base = future(store)
    jobs = (new_job(f"bulk-{i}", base + i * SECOND, shard=i % 2) for i in range(250))
    assert store.load_jobs(jobs) == 250
    assert store.counts_by_status() == {JobStatus.PENDING: 250}
    stored = store.get("bulk-7")
    assert stored is not None
    assert stored.due_at == base + 7 * SECOND
    assert stored.due_bucket == to_bucket(base + 7 * SECOND)
    assert stored.shard == 1
    assert stored.kwargs == {"flag": True}


def test_insert_many_empty_writes_nothing(store: JobStore) -> None:
    assert store.load_jobs([]) == 0
    assert store.counts_by_status() == {}


def test_insert_many_duplicate_in_batch_writes_nothing(store: JobStore) -> None:
    due = future(store)
    jobs = [new_job("a", due), new_job("twice", due), new_job("b", due), new_job("twice", due)]
    with pytest.raises(DuplicateJob) as info:
        store.load_jobs(jobs)
    assert info.value.key == "twice"
    assert store.counts_by_status() == {}


def test_insert_many_duplicate_of_existing_writes_nothing(store: JobStore) -> None:
    due = future(store)
    store.add_job(new_job("old", due))
    with pytest.raises(DuplicateJob) as info:
        store.load_jobs([new_job("new-1", due), new_job("old", due), new_job("new-2", due)])
    assert info.value.key == "old"
    assert store.counts_by_status() == {JobStatus.PENDING: 1}
    assert store.get("new-1") is None


class Invalid(ValueError):
    pass


def test_insert_many_iterator_error_propagates_and_writes_nothing(store: JobStore) -> None:
    due = future(store)
    error = Invalid("row 3 is invalid")
    consumed: list[int] = []

    def rows() -> Iterator[NewJob]:
        for i in range(5):
            if i == 3:
                raise error
            consumed.append(i)
            yield new_job(f"r{i}", due)

    with pytest.raises(Invalid) as info:
        store.load_jobs(rows())
    assert info.value is error
    assert consumed == [0, 1, 2]
    assert store.counts_by_status() == {}
    # The store is still usable afterwards.
    assert store.load_jobs([new_job("after", due)]) == 1


# -- add_occurrences ----------------------------------------------------------


def test_insert_occurrences_skips_existing_keys(store: JobStore) -> None:
    due = future(store)
    store.add_job(new_job("tick@1", due))
    fresh = [new_job("tick@2", due), new_job("tick@3", due + SECOND)]
    written = store.add_occurrences([new_job("tick@1", due), *fresh, new_job("tick@2", due)])
    assert sorted(written) == sorted(job.id for job in fresh)
    assert store.counts_by_status() == {JobStatus.PENDING: 3}
    assert store.add_occurrences([]) == []
    assert store.add_occurrences(fresh) == []


# -- cancel --------------------------------------------------------------------------


def test_cancel_only_while_pending(store: JobStore) -> None:
    store.add_job(new_job("c1", future(store)))
    assert store.cancel("c1") is True
    cancelled = store.get("c1")
    assert cancelled is not None
    assert cancelled.status is JobStatus.CANCELLED
    assert cancelled.finished_at is not None
    assert store.cancel("c1") is False
    assert store.cancel("missing") is False

    claim_one(store, "c2")
    assert store.cancel("c2") is False
    assert status_of(store, "c2") is JobStatus.DISPATCHED


def test_cancelled_job_is_never_claimed(store: JobStore) -> None:
    store.add_job(new_job("gone", past(store, 10)))
    store.cancel("gone")
    assert store.claim_due(shard=0, epoch=leader(store), limit=10) == []


# -- epochs ---------------------------------------------------------------------------


def test_acquire_epoch_increments_per_shard(store: JobStore) -> None:
    assert store.current_epoch(0) == 0
    first = store.acquire_epoch(0, "a")
    second = store.acquire_epoch(0, "b")
    other = store.acquire_epoch(1, "c")
    assert 0 < first < second and other > 0
    # The counter part counts elections; the low bits are random.
    assert [election_count(e) for e in (first, second, other)] == [1, 2, 1]
    assert store.current_epoch(0) == second
    assert store.current_epoch(1) == other
    assert store.current_epoch(5) == 0
    # Whatever the random low bits, each election counts one more.
    later = [store.acquire_epoch(0, f"x{i}") for i in range(20)]
    assert [election_count(e) for e in later] == list(range(3, 23))


# -- due_soon ------------------------------------------------------------------------


def test_due_soon_lists_pending_within_window_oldest_first(store: JobStore) -> None:
    now = store.now()
    store.add_job(new_job("overdue", now - 30 * SECOND))
    store.add_job(new_job("soon", now + 20 * SECOND))
    store.add_job(new_job("later", now + 600 * SECOND))
    store.add_job(new_job("other-shard", now + 10 * SECOND, shard=1))
    store.add_job(new_job("cancelled", now + 5 * SECOND))
    store.cancel("cancelled")
    ids = {key: job.id for key in ("overdue", "soon") if (job := store.get(key))}

    items = store.due_soon(shard=0, within=60, limit=10)
    assert [job_id for job_id, _ in items] == [ids["overdue"], ids["soon"]]
    assert items[0][1] == now - 30 * SECOND
    assert store.due_soon(shard=0, within=60, limit=1) == items[:1]
    assert store.due_soon(shard=0, within=60, limit=10, after=now) == items[1:]
    # Read-only: nothing changed state.
    assert status_of(store, "overdue") is JobStatus.PENDING


# -- oldest_due_pending ------------------------------------------------------------------


def test_oldest_due_pending_is_the_oldest_due_pending_job_of_the_shard(store: JobStore) -> None:
    assert store.oldest_due_pending(shard=0) is None
    now = store.now()
    store.add_job(new_job("future", now + 600 * SECOND))
    assert store.oldest_due_pending(shard=0) is None  # pending but not due
    store.add_job(new_job("newer", now - 10 * SECOND))
    store.add_job(new_job("older", now - 40 * SECOND))
    store.add_job(new_job("cancelled", now - 90 * SECOND))
    store.cancel("cancelled")
    store.add_job(new_job("other-shard", now - 300 * SECOND, shard=1))

    oldest = store.oldest_due_pending(shard=0)
    assert oldest == now - 40 * SECOND
    assert oldest is not None and oldest.utcoffset() == dt.timedelta(0)
    assert store.oldest_due_pending(shard=1) == now - 300 * SECOND
    # Claimed (dispatched) jobs are no longer the backlog.
    epoch = leader(store)
    assert [job.key for job in store.claim_due(shard=0, epoch=epoch, limit=1)] == ["older"]
    assert store.oldest_due_pending(shard=0) == now - 10 * SECOND
    store.claim_due(shard=0, epoch=epoch, limit=10)
    assert store.oldest_due_pending(shard=0) is None


# -- claim_due -------------------------------------------------------------------------


def test_claim_due_takes_oldest_due_first_up_to_limit(store: JobStore) -> None:
    now = store.now()
    offsets = [50, 10, 40, 20, 30]  # inserted out of order
    for offset in offsets:
        store.add_job(new_job(f"due-{offset}", now - offset * SECOND))
    store.add_job(new_job("future-1", now + 120 * SECOND))
    store.add_job(new_job("future-2", now + 86400 * SECOND))
    store.add_job(new_job("shard-1", now - 60 * SECOND, shard=1))
    epoch = leader(store)

    first = store.claim_due(shard=0, epoch=epoch, limit=3)
    assert [job.key for job in first] == ["due-50", "due-40", "due-30"]
    for job in first:
        assert job.status is JobStatus.DISPATCHED
        assert job.leader_epoch == epoch
        assert job.dispatched_at is not None
        assert store.get(job.key) == job
    second = store.claim_due(shard=0, epoch=epoch, limit=3)
    assert [job.key for job in second] == ["due-20", "due-10"]
    assert store.claim_due(shard=0, epoch=epoch, limit=3) == []
    assert status_of(store, "future-1") is JobStatus.PENDING
    assert status_of(store, "shard-1") is JobStatus.PENDING


def test_claim_due_with_stale_epoch_claims_nothing(store: JobStore) -> None:
    store.add_job(new_job("j", past(store, 5)))
    with pytest.raises(StaleEpoch):
        store.claim_due(shard=0, epoch=0, limit=10)  # no leader was ever elected
    old = leader(store)
    new = leader(store)
    with pytest.raises(StaleEpoch):
        store.claim_due(shard=0, epoch=old, limit=10)
    with pytest.raises(StaleEpoch):
        store.claim_due(shard=0, epoch=new + 1, limit=10)
    assert status_of(store, "j") is JobStatus.PENDING
    assert [job.key for job in store.claim_due(shard=0, epoch=new, limit=10)] == ["j"]


def test_epochs_are_per_shard(store: JobStore) -> None:
    store.add_job(new_job("s1", past(store, 5), shard=1))
    epoch0 = leader(store, 0)
    epoch0 = leader(store, 0)
    epoch1 = leader(store, 1)
    assert epoch0 != epoch1
    with pytest.raises(StaleEpoch):
        store.claim_due(shard=1, epoch=epoch0, limit=10)
    assert [job.key for job in store.claim_due(shard=1, epoch=epoch1, limit=10)] == ["s1"]


# -- claim_ids ------------------------------------------------------------------------


def test_claim_ids_ignores_not_due_and_not_pending(store: JobStore) -> None:
    now = store.now()
    due_a = store.add_job(new_job("a", now - 20 * SECOND))
    due_b = store.add_job(new_job("b", now - 30 * SECOND))
    not_due = store.add_job(new_job("not-due", now + 600 * SECOND))
    cancelled = store.add_job(new_job("cancelled", now - 10 * SECOND))
    store.cancel("cancelled")
    other_shard = store.add_job(new_job("other", now - 10 * SECOND, shard=1))
    store.add_job(new_job("untouched", now - 10 * SECOND))
    epoch = leader(store)

    ids = [due_a.id, not_due.id, cancelled.id, other_shard.id, due_b.id, uuid.uuid4()]
    claimed = store.claim_ids(ids, shard=0, epoch=epoch)
    assert [job.key for job in claimed] == ["b", "a"]
    assert all(job.status is JobStatus.DISPATCHED for job in claimed)
    assert all(job.leader_epoch == epoch for job in claimed)
    # Already dispatched now, so a second claim of the same ids gets nothing.
    assert store.claim_ids(ids, shard=0, epoch=epoch) == []
    assert status_of(store, "not-due") is JobStatus.PENDING
    assert status_of(store, "untouched") is JobStatus.PENDING
    assert status_of(store, "other") is JobStatus.PENDING
    assert store.claim_ids([], shard=0, epoch=epoch) == []


def test_claim_ids_is_fenced(store: JobStore) -> None:
    job = store.add_job(new_job("f", past(store, 5)))
    stale = leader(store)
    leader(store)
    with pytest.raises(StaleEpoch):
        store.claim_ids([job.id], shard=0, epoch=stale)
    assert status_of(store, "f") is JobStatus.PENDING


# -- release / mark_expired -----------------------------------------------------------------


def test_release_is_fenced_by_epoch(store: JobStore) -> None:
    job, epoch = claim_one(store, "r")
    assert store.release([job.id], epoch=epoch + 1, due=due_of(job)) == 0
    assert status_of(store, "r") is JobStatus.DISPATCHED
    assert store.release([job.id], epoch=epoch, due=due_of(job)) == 1
    released = store.get("r")
    assert released is not None
    assert released.status is JobStatus.PENDING
    assert released.dispatched_at is None
    assert released.attempt == 0
    assert store.release([job.id], epoch=epoch, due=due_of(job)) == 0
    assert [j.key for j in store.claim_due(shard=0, epoch=epoch, limit=5)] == ["r"]
    assert store.release([], epoch=epoch, due=due_of(job)) == 0


def test_mark_expired_is_fenced_by_epoch(store: JobStore) -> None:
    job, epoch = claim_one(store, "x", expires_at=past(store, 1))
    assert store.mark_expired([job.id], epoch=epoch - 1, reason="late", due=due_of(job)) == 0
    assert status_of(store, "x") is JobStatus.DISPATCHED
    assert (
        store.mark_expired(
            [job.id, uuid.uuid4()], epoch=epoch, reason="expired at 12:00", due=due_of(job)
        )
        == 1
    )
    expired = store.get("x")
    assert expired is not None
    assert expired.status is JobStatus.EXPIRED
    assert expired.last_error == "expired at 12:00"
    assert expired.finished_at is not None
    assert store.mark_expired([], epoch=epoch, reason="r", due=due_of(job)) == 0


# -- reconcile -------------------------------------------------------------------------------


def test_reconcile_requeues_past_visibility_timeout(store: JobStore) -> None:
    tracked(store)
    now = store.now()
    store.add_job(new_job("quick", now - 5 * SECOND, visibility_timeout=0.2))
    store.add_job(new_job("patient", now - 5 * SECOND))  # uses the default timeout
    epoch = leader(store)
    assert len(store.claim_due(shard=0, epoch=epoch, limit=10)) == 2
    time.sleep(0.4)

    result = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=300)
    assert (result.requeued, result.dead, result.timed_out) == (1, 0, 0)
    quick = store.get("quick")
    assert quick is not None
    assert quick.status is JobStatus.PENDING
    assert quick.attempt == 1
    assert quick.dispatched_at is None
    assert status_of(store, "patient") is JobStatus.DISPATCHED

    # With a short default timeout the other one goes too.
    result = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=0.2)
    assert (result.requeued, result.dead) == (1, 0)
    assert status_of(store, "patient") is JobStatus.PENDING


def test_reconcile_requeues_each_timeout_when_it_runs_out(store: JobStore) -> None:
    # Jobs with a timeout of their own, shorter and longer than the
    # default, and jobs without one, each requeued once (and only once)
    # their own timeout ran out, whatever the others' (the store reads them
    # by when they go stale, issue #31); another shard's jobs are left.
    tracked(store)
    now = store.now()
    kinds = {"short": 0.2, "default": None, "long": 2.0}
    for name, timeout in kinds.items():
        store.add_job(new_job(name, now - 5 * SECOND, visibility_timeout=timeout))
        store.add_job(new_job(f"{name}-1", now - 5 * SECOND, visibility_timeout=0.01, shard=1))
    epoch = leader(store)
    assert len(store.claim_due(shard=0, epoch=epoch, limit=10)) == 3
    other = leader(store, 1)
    assert len(store.claim_due(shard=1, epoch=other, limit=10)) == 3
    claimed = time.monotonic()

    def requeued_after(seconds: float) -> set[str]:
        time.sleep(max(claimed + seconds - time.monotonic(), 0))
        store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=1.0)
        return {name for name in kinds if status_of(store, name) is JobStatus.PENDING}

    assert requeued_after(0.5) == {"short"}
    assert requeued_after(1.4) == {"short", "default"}
    assert requeued_after(2.4) == {"short", "default", "long"}
    assert all(store.get(name).attempt == 1 for name in kinds)  # type: ignore[union-attr]
    assert {status_of(store, f"{name}-1") for name in kinds} == {JobStatus.DISPATCHED}


def test_a_job_no_worker_tracks_is_marked_sent_not_requeued(store: JobStore) -> None:
    # #15 (1): workers without tracking report nothing; a requeue of their
    # job could only run it twice. It was sent once, as stock beat sends it.
    now = store.now()
    for key, task in (("alone", "t.untracked"), ("other", "t.untracked"), ("mine", "t.mine")):
        store.add_job(new_job(key, now - 5 * SECOND, task=task, visibility_timeout=0.1))
    epoch = leader(store)
    published(store, store.claim_due(shard=0, epoch=epoch, limit=10), count=3)
    time.sleep(0.3)
    tracked(store, "t.mine", "t.else")  # a tracking worker, of other tasks

    result = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=300)
    assert (result.requeued, result.dead, result.untracked) == (1, 0, 2)
    mine = store.get("mine")
    assert mine is not None and (mine.status, mine.attempt) == (JobStatus.PENDING, 1)
    alone = store.get("alone")
    assert alone is not None
    assert (alone.status, alone.attempt) == (JobStatus.SENT, 0)
    assert alone.status.finished and alone.finished_at is not None
    assert alone.last_error is not None and "t.untracked" in alone.last_error
    # Finished: nothing moves it again, and pruning takes it.
    again = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=0.1)
    assert (again.requeued, again.untracked) == (0, 0)
    assert status_of(store, "alone") is JobStatus.SENT


def published(store: JobStore, claimed: list[Job], *, count: int) -> None:
    """Record ``claimed`` (``count`` jobs of one claim) as published, as the
    beat does once their messages went out."""
    assert len(claimed) == count
    claims = {job.claim_id for job in claimed}
    assert len(claims) == 1 and None not in claims
    store.record_published([job.claim_id for job in claimed[:1] if job.claim_id], shard=0)


def test_a_claim_never_recorded_as_published_is_requeued_even_untracked(
    store: JobStore,
) -> None:
    # #30 (1): a beat killed between claim and publish left its claim
    # dispatched; the reconciler marked it sent (no worker tracks the task)
    # and it never ran. Only a claim recorded as published ends sent.
    now = store.now()
    for key in ("sent-1", "sent-2", "lost-1", "lost-2"):
        store.add_job(new_job(key, now - 5 * SECOND, task="t.untracked", visibility_timeout=0.1))
    epoch = leader(store)
    first = store.claim_ids(
        [job.id for key in ("sent-1", "sent-2") if (job := store.get(key))], shard=0, epoch=epoch
    )
    published(store, first, count=2)
    second = store.claim_due(shard=0, epoch=epoch, limit=10)
    assert sorted(job.key for job in second) == ["lost-1", "lost-2"]
    assert {job.claim_id for job in second}.isdisjoint({job.claim_id for job in first})
    time.sleep(0.3)
    tracked(store, "t.else")  # a tracking worker, of another task

    result = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=300)
    assert (result.requeued, result.dead, result.untracked) == (2, 0, 2)
    for key in ("sent-1", "sent-2"):
        assert status_of(store, key) is JobStatus.SENT
    for key in ("lost-1", "lost-2"):
        job = store.get(key)
        assert job is not None and (job.status, job.attempt) == (JobStatus.PENDING, 1)
    # Recording a claim twice is harmless.
    store.record_published([first[0].claim_id or 0] * 2, shard=0)


def test_records_of_published_claims_are_pruned_with_the_finished_jobs(store: JobStore) -> None:
    now = store.now()
    store.add_job(new_job("old", now - 5 * SECOND, task="t.untracked", visibility_timeout=0.1))
    epoch = leader(store)
    published(store, store.claim_due(shard=0, epoch=epoch, limit=10), count=1)
    time.sleep(0.3)
    store.prune(older_than=0.1, batch=10)
    # The record went with the prune: the job now counts as never sent.
    result = store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=300)
    assert (result.requeued, result.untracked) == (1, 0)


def test_a_worker_that_lists_no_tasks_tracks_every_task(store: JobStore) -> None:
    # A worker of before the task lists (NULL) counts as tracking everything.
    _job, epoch = claim_one(store, "legacy", task="t.any", visibility_timeout=0.1)
    time.sleep(0.3)
    tracked(store)
    result = store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=300)
    assert (result.requeued, result.untracked) == (1, 0)
    assert status_of(store, "legacy") is JobStatus.PENDING


def test_the_limit_counts_jobs_marked_sent(store: JobStore) -> None:
    now = store.now()
    for i in range(3):
        store.add_job(new_job(f"u{i}", now - (10 - i) * SECOND, visibility_timeout=0.1))
    epoch = leader(store)
    published(store, store.claim_due(shard=0, epoch=epoch, limit=10), count=3)
    time.sleep(0.3)
    result = store.reconcile(shard=0, epoch=epoch, limit=2, default_visibility_timeout=300)
    assert result.untracked == 2
    statuses = sorted(status_of(store, f"u{i}") for i in range(3))
    assert statuses == [JobStatus.DISPATCHED, JobStatus.SENT, JobStatus.SENT]


def test_reconcile_marks_dead_after_max_attempts(store: JobStore) -> None:
    tracked(store)
    store.add_job(new_job("doomed", past(store, 5), max_attempts=2))
    epoch = leader(store)
    for expected_attempt in (1, 2):
        assert [j.key for j in store.claim_due(shard=0, epoch=epoch, limit=5)] == ["doomed"]
        time.sleep(0.25)
        store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=0.1)
        job = store.get("doomed")
        assert job is not None
        assert job.attempt == expected_attempt
    assert job is not None
    assert job.status is JobStatus.DEAD
    assert job.last_error
    assert job.finished_at is not None
    assert store.claim_due(shard=0, epoch=epoch, limit=5) == []


def test_reconcile_counts_dead(store: JobStore) -> None:
    tracked(store)
    store.add_job(new_job("once", past(store, 5), max_attempts=1))
    store.add_job(new_job("twice", past(store, 5), max_attempts=2))
    epoch = leader(store)
    store.claim_due(shard=0, epoch=epoch, limit=5)
    time.sleep(0.25)
    result = store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=0.1)
    assert (result.requeued, result.dead, result.timed_out) == (1, 1, 0)
    assert status_of(store, "once") is JobStatus.DEAD
    assert status_of(store, "twice") is JobStatus.PENDING


def test_reconcile_respects_limit(store: JobStore) -> None:
    tracked(store)
    for i in range(5):
        store.add_job(new_job(f"l{i}", past(store, 10 - i)))
    epoch = leader(store)
    store.claim_due(shard=0, epoch=epoch, limit=10)
    time.sleep(0.25)
    result = store.reconcile(shard=0, epoch=epoch, limit=3, default_visibility_timeout=0.1)
    assert result.requeued == 3
    assert store.counts_by_status() == {JobStatus.PENDING: 3, JobStatus.DISPATCHED: 2}


def test_reconcile_is_fenced(store: JobStore) -> None:
    _job, epoch = claim_one(store, "fenced")
    time.sleep(0.25)
    leader(store)
    with pytest.raises(StaleEpoch):
        store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=0.1)
    assert status_of(store, "fenced") is JobStatus.DISPATCHED


def test_reconcile_requeues_running_past_max_runtime(store: JobStore) -> None:
    job, epoch = claim_one(store, "slow", max_runtime=0.2)
    store.add_job(new_job("no-limit", past(store, 5)))
    other = store.claim_due(shard=0, epoch=epoch, limit=5)
    assert store.mark_running(job.id, worker="w1") is True
    assert store.mark_running(other[0].id, worker="w1") is True
    time.sleep(0.4)
    result = store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=300)
    assert (result.requeued, result.dead, result.timed_out) == (1, 0, 1)
    slow = store.get("slow")
    assert slow is not None
    assert slow.status is JobStatus.PENDING
    assert slow.attempt == 1
    assert slow.last_error is not None and "max_runtime" in slow.last_error
    assert status_of(store, "no-limit") is JobStatus.RUNNING


# -- worker transitions -----------------------------------------------------------------------


def test_worker_transitions(store: JobStore) -> None:
    job, _epoch = claim_one(store, "w")
    assert store.mark_retrying(job.id, error="not running yet") is False
    assert store.mark_running(job.id, worker="worker@a") is True
    running = store.get("w")
    assert running is not None
    assert running.status is JobStatus.RUNNING
    assert running.worker == "worker@a"
    assert running.started_at is not None
    assert store.mark_running(job.id, worker="worker@b") is False

    assert store.mark_retrying(job.id, error="ConnectionError: boom") is True
    retrying = store.get("w")
    assert retrying is not None
    assert retrying.status is JobStatus.RETRYING
    assert retrying.last_error == "ConnectionError: boom"

    assert store.mark_running(job.id, worker="worker@b") is True
    assert store.mark_finished(job.id, JobStatus.FAILED, error="ValueError: bad") is True
    failed = store.get("w")
    assert failed is not None
    assert failed.status is JobStatus.FAILED
    assert failed.last_error == "ValueError: bad"
    assert failed.finished_at is not None
    assert store.mark_finished(job.id, JobStatus.SUCCEEDED) is False
    assert store.mark_running(job.id, worker="worker@c") is False
    assert store.mark_running(uuid.uuid4(), worker="worker@c") is False


def test_worker_may_start_a_pending_job_and_finish_it(store: JobStore) -> None:
    # A broker redelivery after a reconciler requeue reaches a worker while
    # the row is pending again (its due time past, as when it was claimed).
    job = store.add_job(new_job("p", past(store, 60)))
    assert store.mark_running(job.id, worker="w") is True
    assert store.mark_finished(job.id, JobStatus.SUCCEEDED) is True
    assert status_of(store, "p") is JobStatus.SUCCEEDED


def test_reports_about_a_job_due_beyond_the_margin_are_ignored(store: JobStore) -> None:
    # No worker can hold a job due later than SENT_DUE_MARGIN from now: it
    # was never claimed. Its reports change nothing (on PostgreSQL the
    # statements by id do not even look in the partitions of those days).
    later = store.add_job(new_job("later", store.now() + SENT_DUE_MARGIN + HOUR))
    assert store.mark_running(later.id, worker="w") is False
    assert store.mark_finished(later.id, JobStatus.SUCCEEDED) is False
    assert (
        store.apply_worker_updates(
            [WorkerUpdate(job_id=later.id, status=JobStatus.RUNNING, worker="w")]
        )
        == 0
    )
    assert status_of(store, "later") is JobStatus.PENDING
    # Within the margin (a clock a little ahead), it is.
    soon = store.add_job(new_job("soon", store.now() + HOUR))
    assert store.mark_running(soon.id, worker="w") is True


def test_reports_naming_their_jobs_due_time_find_only_that_job(store: JobStore) -> None:
    """A message's ``celery_sched_due`` header names its job's row (issue #30):
    a report naming another due time changes nothing; one naming none (a
    message of before) finds the job by the margin."""
    due = past(store, 5)
    job = store.add_job(new_job("dated", due))
    other = due + SECOND
    assert store.mark_running(job.id, worker="w", due_at=other) is False
    running = WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w", due_at=other)
    assert store.apply_worker_updates([running]) == 0
    assert status_of(store, "dated") is JobStatus.PENDING
    assert store.mark_running(job.id, worker="w", due_at=due) is True
    assert store.mark_retrying(job.id, error="again", due_at=other) is False
    assert store.mark_retrying(job.id, error="again", due_at=due) is True
    # A batch of dated and undated reports (a worker's queue across an upgrade).
    plain = store.add_job(new_job("undated", due))
    batch = [
        WorkerUpdate(job_id=job.id, status=JobStatus.RUNNING, worker="w", due_at=due),
        WorkerUpdate(job_id=job.id, status=JobStatus.SUCCEEDED, due_at=due),
        WorkerUpdate(job_id=plain.id, status=JobStatus.RUNNING, worker="w"),
    ]
    assert store.apply_worker_updates(batch) == 3
    assert status_of(store, "dated") is JobStatus.SUCCEEDED
    assert status_of(store, "undated") is JobStatus.RUNNING
    assert store.mark_finished(plain.id, JobStatus.FAILED, due_at=other) is False
    assert store.mark_finished(plain.id, JobStatus.FAILED, due_at=due) is True


def test_a_leaders_transitions_by_id_find_only_jobs_within_their_due_span(
    store: JobStore,
) -> None:
    job, epoch = claim_one(store, "spanned")
    later = DueSpan(earliest=job.due_at + SECOND, latest=job.due_at + HOUR)
    assert store.release([job.id], epoch=epoch, due=later) == 0
    assert store.fail_dispatch([(job.id, "x")], epoch=epoch, due=later).requeued == 0
    assert store.mark_missed([(job.id, "x")], epoch=epoch, due=later) == []
    assert status_of(store, "spanned") is JobStatus.DISPATCHED
    around = DueSpan(earliest=job.due_at - HOUR, latest=job.due_at)
    assert store.release([job.id], epoch=epoch, due=around) == 1


def test_mark_finished_refuses_unfinished_status(store: JobStore) -> None:
    job = store.add_job(new_job("u", future(store)))
    with pytest.raises(ValueError):
        store.mark_finished(job.id, JobStatus.RUNNING)
    assert status_of(store, "u") is JobStatus.PENDING


# -- counts ----------------------------------------------------------------------------------


def test_counts_by_status_and_hour(store: JobStore) -> None:
    hour = (store.now() + 48 * HOUR).replace(minute=0, second=0, microsecond=0)
    for i in range(3):
        store.add_job(new_job(f"h1-{i}", hour + (10 + i) * dt.timedelta(minutes=1)))
    for i in range(2):
        store.add_job(new_job(f"h2-{i}", hour + HOUR + i * SECOND))
    store.cancel("h2-0")
    assert store.counts_by_status() == {JobStatus.PENDING: 4, JobStatus.CANCELLED: 1}
    assert store.counts_by_hour() == {hour: 3, hour + HOUR: 2}
    assert store.counts_by_hour(JobStatus.PENDING) == {hour: 3, hour + HOUR: 1}
    assert store.counts_by_hour(JobStatus.CANCELLED) == {hour + HOUR: 1}
    assert store.counts_by_hour(JobStatus.DEAD) == {}
    for key in store.counts_by_hour():
        assert key.utcoffset() == dt.timedelta(0)


# -- prune ---------------------------------------------------------------------------------


def test_prune_deletes_old_finished_jobs_in_batches(store: JobStore) -> None:
    due = future(store)
    for i in range(7):
        store.add_job(new_job(f"done-{i}", due))
        store.cancel(f"done-{i}")
    store.add_job(new_job("pending", due))
    running = store.add_job(new_job("running", past(store, 60)))
    assert store.mark_running(running.id, worker="w") is True
    assert store.prune(older_than=3600, batch=3) == 0
    time.sleep(0.05)

    # Bounded: at most max_batches transactions of batch rows each.
    assert store.prune(older_than=0, batch=3, max_batches=1) == 3
    assert store.prune(older_than=0, batch=3) == 4
    assert store.counts_by_status() == {JobStatus.PENDING: 1, JobStatus.RUNNING: 1}
    assert store.get("done-0") is None
    assert store.prune(older_than=0, batch=3) == 0
    # A pruned key can be scheduled again.
    store.add_job(new_job("done-0", due))


# -- failed publishes, expiry by the store's clock, shards (issue 13) --------------------


def test_fail_dispatch_counts_an_attempt_and_says_why(store: JobStore) -> None:
    store.add_job(new_job("unroutable", past(store, 6), max_attempts=3))
    store.add_job(new_job("fine", past(store, 5)))
    epoch = leader(store)
    job, other = store.claim_due(shard=0, epoch=epoch, limit=10)
    assert (job.key, other.key) == ("unroutable", "fine")
    reason = "queue 'nowhere' is not in task_queues"
    result = store.fail_dispatch(
        [(job.id, reason), (uuid.uuid4(), "unknown id")], epoch=epoch, due=due_of(job)
    )
    assert (result.requeued, result.dead, result.timed_out) == (1, 0, 0)
    failed = store.get("unroutable")
    assert failed is not None
    assert (failed.status, failed.attempt) == (JobStatus.PENDING, 1)
    assert failed.dispatched_at is None and failed.finished_at is None
    assert failed.last_error == f"not published: {reason} (attempt 1 of 3)"
    assert status_of(store, "fine") is JobStatus.DISPATCHED and other.attempt == 0
    # Claimable again, like a released job.
    assert [j.key for j in store.claim_due(shard=0, epoch=epoch, limit=5)] == ["unroutable"]
    assert store.fail_dispatch([], epoch=epoch, due=due_of(job)) == type(result)()


def test_fail_dispatch_is_fenced_by_epoch(store: JobStore) -> None:
    job, epoch = claim_one(store, "f")
    result = store.fail_dispatch([(job.id, "x")], epoch=epoch + 1, due=due_of(job))
    assert (result.requeued, result.dead) == (0, 0)
    kept = store.get("f")
    assert kept is not None and (kept.status, kept.attempt) == (JobStatus.DISPATCHED, 0)
    # Only dispatched rows move: a pending (released) job is left alone.
    assert store.release([job.id], epoch=epoch, due=due_of(job)) == 1
    assert store.fail_dispatch([(job.id, "x")], epoch=epoch, due=due_of(job)).requeued == 0
    assert store.get("f").attempt == 0  # type: ignore[union-attr]


def test_fail_dispatch_gives_up_at_max_attempts(store: JobStore) -> None:
    store.add_job(new_job("poison", past(store, 5), max_attempts=2))
    epoch = leader(store)
    for attempt, expected in ((1, JobStatus.PENDING), (2, JobStatus.DEAD)):
        [job] = store.claim_due(shard=0, epoch=epoch, limit=5)
        result = store.fail_dispatch([(job.id, "WRONGTYPE")], epoch=epoch, due=due_of(job))
        assert (result.requeued, result.dead) == (
            (1, 0) if expected is JobStatus.PENDING else (0, 1)
        )
        stored = store.get("poison")
        assert stored is not None and (stored.status, stored.attempt) == (expected, attempt)
    assert stored.finished_at is not None
    assert stored.last_error == "not published: WRONGTYPE (attempt 2 of 2); giving up"
    assert store.claim_due(shard=0, epoch=epoch, limit=5) == []


def test_mark_expired_rechecks_expiry_by_the_store_clock(store: JobStore) -> None:
    """A caller whose clock runs ahead cannot expire a job early."""
    job, epoch = claim_one(store, "later", expires_at=future(store, 600))
    assert store.mark_expired([job.id], epoch=epoch, reason="expired", due=due_of(job)) == 0
    assert status_of(store, "later") is JobStatus.DISPATCHED


def test_unfinished_by_shard_counts_rows_from_a_shard_on(store: JobStore) -> None:
    now = store.now()
    store.add_job(new_job("s0", now - SECOND, shard=0))
    for key in ("p1", "p1b", "d1"):
        store.add_job(new_job(key, now - SECOND, shard=1))
    store.add_job(new_job("p3", now + HOUR, shard=3))
    store.add_job(new_job("c3", now + HOUR, shard=3))
    assert store.cancel("c3")
    epoch = store.acquire_epoch(1, "t")
    [claimed] = store.claim_ids([store.get("d1").id], shard=1, epoch=epoch)  # type: ignore[union-attr]
    store.add_job(new_job("r3", now - SECOND, shard=3))
    r3 = store.get("r3")
    assert r3 is not None and store.mark_running(r3.id, worker="w")
    assert store.unfinished_by_shard(from_shard=1) == {
        1: {JobStatus.PENDING: 2, JobStatus.DISPATCHED: 1},
        3: {JobStatus.PENDING: 1, JobStatus.RUNNING: 1},
    }
    assert store.unfinished_by_shard(from_shard=4) == {}
    assert claimed.key == "d1"


# -- missed occurrences (issue 15, point 5) -----------------------------------------------


def test_mark_missed_finishes_jobs_never_sent_fenced_by_epoch(store: JobStore) -> None:
    store.add_job(new_job("late-1", past(store, 30)))
    store.add_job(new_job("late-2", past(store, 20)))
    store.add_job(new_job("resent", past(store, 10)))
    epoch = leader(store)
    late_1, _late_2, resent = store.claim_due(shard=0, epoch=epoch, limit=10)
    # A job sent before (requeued with an attempt counted) never becomes missed.
    store.fail_dispatch([(resent.id, "queue refused it")], epoch=epoch, due=due_of(resent))
    (resent,) = store.claim_due(shard=0, epoch=epoch, limit=10)
    assert resent.attempt == 1

    reasons = [(late_1.id, "missed: policy skip"), (resent.id, "missed: no")]
    assert (
        store.mark_missed(reasons, epoch=epoch + 1, due=due_of(late_1, resent)) == []
    )  # a stale epoch moves nothing
    assert status_of(store, "late-1") is JobStatus.DISPATCHED
    moved = store.mark_missed(
        [*reasons, (uuid.uuid4(), "unknown id")], epoch=epoch, due=due_of(late_1, resent)
    )
    assert moved == [late_1.id]
    missed = store.get("late-1")
    assert missed is not None and missed.status is JobStatus.MISSED
    assert missed.last_error == "missed: policy skip" and missed.finished_at is not None
    assert status_of(store, "resent") is JobStatus.DISPATCHED
    assert status_of(store, "late-2") is JobStatus.DISPATCHED
    assert store.mark_missed([], epoch=epoch, due=due_of(late_1, resent)) == []
    # Finished: counted as such, pruned with the others, its key free again.
    assert JobStatus.MISSED.finished
    assert store.counts_by_status()[JobStatus.MISSED] == 1
    time.sleep(0.05)
    assert store.prune(older_than=0, batch=10) == 1
    assert store.get("late-1") is None
