"""The idempotency ledger contract, run against every Ledger backend.

Both backends use a real clock (the memory ledger's default clock, Postgres
``now()``), so leases here are short and tests sleep past them.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from celery_sched.errors import LedgerConflict
from celery_sched.interfaces import JobStore, Ledger
from celery_sched.models import (
    ClaimOutcome,
    DeliveryCheck,
    Job,
    JobStatus,
    LedgerState,
    WorkerUpdate,
)
from celery_sched.settings import Settings
from tests.contract.conftest import new_job, tracked

LONG = 60.0
SHORT = 0.3


class Effects:
    """Where a ledger transaction's own writes go (a table on Postgres)."""

    def __init__(self, settings: Settings | None) -> None:
        self.settings = settings
        self.memory: list[str] = []
        if settings is not None:
            import psycopg

            with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
                conn.execute(f'CREATE TABLE "{settings.db_schema}".effects (k text)')

    def write(self, conn: Any, value: str) -> None:
        if self.settings is None:
            self.memory.append(value)  # the memory ledger has nothing to roll back
        else:
            conn.execute(
                text(f'INSERT INTO "{self.settings.db_schema}".effects VALUES (:v)'), {"v": value}
            )

    def lose(self, ledger: Ledger, key: str) -> None:
        """Forget ``key``'s row, as a crash forgets an asynchronously committed take."""
        if self.settings is None:
            del ledger._rows[key]  # type: ignore[attr-defined]
            return
        import psycopg

        with psycopg.connect(self.settings.libpq_conninfo(), autocommit=True) as conn:
            conn.execute(f'DELETE FROM "{self.settings.db_schema}".ledger WHERE key = %s', (key,))

    def rows(self) -> list[str]:
        if self.settings is None:
            return list(self.memory)
        import psycopg

        with psycopg.connect(self.settings.libpq_conninfo(), autocommit=True) as conn:
            return [
                row[0] for row in conn.execute(f'SELECT k FROM "{self.settings.db_schema}".effects')
            ]


@pytest.fixture(params=["memory", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[Ledger, Effects, JobStore]]:
    """A ledger, where its transactions write, and the job store its fence reads."""
    if request.param == "memory":
        from celery_sched.store.memory import MemoryJobStore, MemoryLedger

        jobs = MemoryJobStore()
        yield MemoryLedger(jobs=jobs), Effects(None), jobs
        return
    from celery_sched.store.postgres import PostgresJobStore, PostgresLedger

    settings: Settings = request.getfixturevalue("settings")
    store = PostgresJobStore(settings)
    store.migrate()
    ledger = PostgresLedger(store)
    yield ledger, Effects(settings), store
    ledger.close()
    store.close()


@pytest.fixture
def ledger(backend: tuple[Ledger, Effects, JobStore]) -> Ledger:
    return backend[0]


def test_a_new_key_is_acquired_once(ledger: Ledger) -> None:
    job_id = uuid.uuid4()
    claim = ledger.acquire("k", owner="a", lease=LONG, job_id=job_id)
    assert claim.outcome == ClaimOutcome.ACQUIRED
    assert claim.attempts == 1
    entry = ledger.get("k")
    assert entry is not None
    assert entry.state == LedgerState.RUNNING
    assert (entry.owner, entry.job_id, entry.attempts) == ("a", job_id, 1)
    assert entry.lease_expires_at is not None and entry.created_at is not None
    assert 50 < (entry.lease_expires_at - entry.created_at).total_seconds() <= LONG + 1
    assert entry.completed_at is None and not entry.result_recorded


def test_get_unknown_key_is_none(ledger: Ledger) -> None:
    assert ledger.get("nope") is None


def test_a_live_lease_holds_off_other_owners(ledger: Ledger) -> None:
    ledger.acquire("k", owner="a", lease=LONG)
    claim = ledger.acquire("k", owner="b", lease=LONG)
    assert claim.outcome == ClaimOutcome.HELD
    assert claim.holder == "a"
    assert 50 < claim.retry_in <= LONG
    entry = ledger.get("k")
    assert entry is not None and entry.owner == "a" and entry.attempts == 1


def test_the_same_owner_acquiring_again_still_holds_it(ledger: Ledger) -> None:
    # A retried acquire whose first reply was lost must not lock itself out.
    ledger.acquire("k", owner="a", lease=LONG)
    claim = ledger.acquire("k", owner="a", lease=LONG)
    assert claim.outcome == ClaimOutcome.ACQUIRED


def test_a_completed_key_returns_its_recorded_result(ledger: Ledger) -> None:
    ledger.acquire("k", owner="a", lease=LONG)
    assert ledger.complete("k", owner="a", result='{"charged": 12.5, "ids": [1, 2]}')
    claim = ledger.acquire("k", owner="b", lease=LONG)
    assert claim.outcome == ClaimOutcome.COMPLETED
    assert claim.result == {"charged": 12.5, "ids": [1, 2]}
    assert claim.result_recorded
    assert claim.completed_at is not None
    entry = ledger.get("k")
    assert entry is not None
    assert entry.state == LedgerState.COMPLETED and entry.lease_expires_at is None
    assert entry.owner == "a"


def test_a_recorded_null_differs_from_no_recorded_result(ledger: Ledger) -> None:
    ledger.acquire("null", owner="a", lease=LONG)
    ledger.complete("null", owner="a", result="null")
    ledger.acquire("none", owner="a", lease=LONG)
    ledger.complete("none", owner="a")
    recorded_null = ledger.acquire("null", owner="b", lease=LONG)
    unrecorded = ledger.acquire("none", owner="b", lease=LONG)
    assert (recorded_null.result, recorded_null.result_recorded) == (None, True)
    assert (unrecorded.result, unrecorded.result_recorded) == (None, False)


def test_completing_again_keeps_the_first_completion_time(ledger: Ledger) -> None:
    ledger.acquire("k", owner="a", lease=LONG)
    assert ledger.complete("k", owner="a")
    first = ledger.get("k")
    time.sleep(0.05)
    assert ledger.complete("k", owner="a", result="[1]")
    second = ledger.get("k")
    assert first is not None and second is not None
    assert second.completed_at == first.completed_at
    assert second.result == [1]


def test_an_expired_lease_is_taken_over_and_the_old_owner_is_fenced(ledger: Ledger) -> None:
    ledger.acquire("k", owner="dead", lease=SHORT)
    time.sleep(SHORT + 0.1)
    claim = ledger.acquire("k", owner="b", lease=LONG)
    assert claim.outcome == ClaimOutcome.ACQUIRED
    assert claim.attempts == 2
    # The old owner wakes up: it can neither complete nor release the key.
    assert not ledger.complete("k", owner="dead", result="1")
    assert not ledger.release("k", owner="dead")
    assert ledger.complete("k", owner="b", result="2")
    entry = ledger.get("k")
    assert entry is not None and (entry.owner, entry.result, entry.attempts) == ("b", 2, 2)


def test_release_frees_a_running_key_for_a_retry(ledger: Ledger) -> None:
    ledger.acquire("k", owner="a", lease=LONG)
    assert not ledger.release("k", owner="b")
    assert ledger.release("k", owner="a")
    assert ledger.get("k") is None
    claim = ledger.acquire("k", owner="retry", lease=LONG)
    assert claim.outcome == ClaimOutcome.ACQUIRED


def test_release_never_undoes_a_completion(ledger: Ledger) -> None:
    ledger.acquire("k", owner="a", lease=LONG)
    ledger.complete("k", owner="a")
    assert not ledger.release("k", owner="a")
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.COMPLETED


def test_renew_extends_only_leases_still_held(ledger: Ledger) -> None:
    ledger.acquire("mine", owner="a", lease=SHORT)
    ledger.acquire("lost", owner="a2", lease=SHORT)
    ledger.acquire("done", owner="a3", lease=LONG)
    ledger.complete("done", owner="a3")
    time.sleep(SHORT + 0.1)
    ledger.acquire("lost", owner="thief", lease=LONG)
    renewed = ledger.renew(
        [("mine", "a"), ("lost", "a2"), ("done", "a3"), ("gone", "a4")], lease=LONG
    )
    assert renewed == {"mine"}
    claim = ledger.acquire("mine", owner="b", lease=LONG)
    assert claim.outcome == ClaimOutcome.HELD and claim.holder == "a"
    assert ledger.renew([], lease=LONG) == set()


def test_racing_acquirers_get_the_key_exactly_once(ledger: Ledger) -> None:
    start = threading.Barrier(8)
    outcomes: list[ClaimOutcome] = []
    lock = threading.Lock()

    def race(owner: str) -> None:
        start.wait()
        claim = ledger.acquire("race", owner=owner, lease=LONG)
        with lock:
            outcomes.append(claim.outcome)

    threads = [threading.Thread(target=race, args=(f"w{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(outcomes) == sorted([ClaimOutcome.ACQUIRED] + [ClaimOutcome.HELD] * 7)


def test_racing_takeovers_of_an_expired_key_have_one_winner(ledger: Ledger) -> None:
    ledger.acquire("k", owner="dead", lease=SHORT)
    time.sleep(SHORT + 0.1)
    start = threading.Barrier(6)
    won: list[str] = []

    def race(owner: str) -> None:
        start.wait()
        if ledger.acquire("k", owner=owner, lease=LONG).outcome == ClaimOutcome.ACQUIRED:
            won.append(owner)

    threads = [threading.Thread(target=race, args=(f"w{i}",)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(won) == 1
    entry = ledger.get("k")
    assert entry is not None and entry.owner == won[0] and entry.attempts == 2


def test_transaction_commits_the_writes_and_the_completion_together(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, effects, _ = backend
    ledger.acquire("k", owner="a", lease=LONG)
    with ledger.transaction("k", owner="a") as conn:
        effects.write(conn, "charged")
    assert effects.rows() == ["charged"]
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert ledger.acquire("k", owner="b", lease=LONG).outcome == ClaimOutcome.COMPLETED


def test_transaction_that_raises_leaves_the_key_running(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, effects, _ = backend
    ledger.acquire("k", owner="a", lease=LONG)
    with pytest.raises(ZeroDivisionError), ledger.transaction("k", owner="a") as conn:
        effects.write(conn, "half-done")
        raise ZeroDivisionError
    if effects.settings is not None:
        assert effects.rows() == []
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.RUNNING and entry.owner == "a"


def test_transaction_whose_key_was_taken_over_commits_nothing(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, effects, _ = backend
    ledger.acquire("k", owner="slow", lease=SHORT)
    with (
        pytest.raises(LedgerConflict, match="taken over"),
        ledger.transaction("k", owner="slow") as conn,
    ):
        effects.write(conn, "late")
        time.sleep(SHORT + 0.1)
        assert ledger.acquire("k", owner="new", lease=LONG).outcome == ClaimOutcome.ACQUIRED
    if effects.settings is not None:
        assert effects.rows() == []
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.RUNNING and entry.owner == "new"


def test_prune_deletes_old_completed_and_abandoned_entries_in_batches(ledger: Ledger) -> None:
    for i in range(5):
        ledger.acquire(f"old{i}", owner="a", lease=LONG)
        ledger.complete(f"old{i}", owner="a")
    ledger.acquire("abandoned", owner="dead", lease=0.05)
    time.sleep(0.4)
    ledger.acquire("fresh", owner="a", lease=LONG)
    ledger.complete("fresh", owner="a")
    ledger.acquire("live", owner="b", lease=LONG)
    ledger.acquire("expiring", owner="c", lease=0.05)

    assert ledger.prune(older_than=0.3, batch=2, max_batches=1) == 2
    assert ledger.prune(older_than=0.3, batch=2) == 4
    for key in ("fresh", "live", "expiring"):
        assert ledger.get(key) is not None, key
    for key in ("old0", "old4", "abandoned"):
        assert ledger.get(key) is None, key
    assert ledger.prune(older_than=0.3, batch=2) == 0
    with pytest.raises(ValueError):
        ledger.prune(older_than=0, batch=0)


# -- issue 13 (3): a job key reused after the old job was pruned ---------------


def test_completion_records_the_job_id_it_completed_for(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, effects, _ = backend
    first, second = uuid.uuid4(), uuid.uuid4()
    ledger.acquire("plain", owner="a", lease=LONG, job_id=first)
    assert ledger.complete("plain", owner="a", result="1", job_id=first)
    ledger.acquire("tx", owner="a", lease=LONG, job_id=second)
    with ledger.transaction("tx", owner="a", job_id=second) as conn:
        effects.write(conn, "tx")
    for key, job_id in (("plain", first), ("tx", second)):
        entry = ledger.get(key)
        assert entry is not None and entry.state == LedgerState.COMPLETED
        assert entry.job_id == job_id, key


def test_a_job_key_completed_for_an_earlier_job_is_taken_over_by_a_new_job(
    ledger: Ledger,
) -> None:
    old, new = uuid.uuid4(), uuid.uuid4()
    ledger.acquire("key", owner="a", lease=LONG, job_id=old, take_completed=True)
    assert ledger.complete("key", owner="a", result='"old"', job_id=old)
    # The same job again (a duplicate delivery): completed, not run.
    again = ledger.acquire("key", owner="b", lease=LONG, job_id=old, take_completed=True)
    assert again.outcome == ClaimOutcome.COMPLETED and again.result == "old"
    # A new job with the same key (the old one was pruned): it runs afresh.
    claim = ledger.acquire("key", owner="c", lease=LONG, job_id=new, take_completed=True)
    assert (claim.outcome, claim.attempts) == (ClaimOutcome.ACQUIRED, 1)
    entry = ledger.get("key")
    assert entry is not None
    assert (entry.state, entry.owner, entry.job_id) == (LedgerState.RUNNING, "c", new)
    assert entry.completed_at is None and not entry.result_recorded
    assert entry.lease_expires_at is not None
    # The old owner cannot complete what the new job now holds.
    assert not ledger.complete("key", owner="a", result='"late"', job_id=old)
    assert ledger.complete("key", owner="c", result='"new"', job_id=new)
    done = ledger.acquire("key", owner="d", lease=LONG, job_id=new, take_completed=True)
    assert done.outcome == ClaimOutcome.COMPLETED and done.result == "new"


def test_an_explicit_key_completed_by_another_job_is_not_taken_over(ledger: Ledger) -> None:
    ledger.acquire("charge:7", owner="a", lease=LONG, job_id=uuid.uuid4())
    ledger.complete("charge:7", owner="a", result="12")
    claim = ledger.acquire("charge:7", owner="b", lease=LONG, job_id=uuid.uuid4())
    assert claim.outcome == ClaimOutcome.COMPLETED and claim.result == 12
    # An entry with no job id recorded cannot be told apart: not taken either.
    ledger.acquire("anon", owner="a", lease=LONG)
    ledger.complete("anon", owner="a")
    anon = ledger.acquire("anon", owner="b", lease=LONG, job_id=uuid.uuid4(), take_completed=True)
    assert anon.outcome == ClaimOutcome.COMPLETED


# -- issue 13 (5): a lost take is re-taken, not mistaken for a takeover ---------


def test_complete_recreates_a_lost_take(backend: tuple[Ledger, Effects, JobStore]) -> None:
    ledger, effects, _ = backend
    job_id = uuid.uuid4()
    ledger.acquire("k", owner="a", lease=LONG, job_id=job_id)
    effects.lose(ledger, "k")
    assert ledger.complete("k", owner="a", result="[3]", job_id=job_id)
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert (entry.owner, entry.job_id, entry.result) == ("a", job_id, [3])
    assert ledger.acquire("k", owner="b", lease=LONG).outcome == ClaimOutcome.COMPLETED


def test_transaction_retakes_a_lost_take_and_commits(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, effects, _ = backend
    job_id = uuid.uuid4()
    ledger.acquire("k", owner="a", lease=LONG, job_id=job_id)
    effects.lose(ledger, "k")
    with ledger.transaction("k", owner="a", job_id=job_id) as conn:
        effects.write(conn, "charged")
    assert effects.rows() == ["charged"]
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert (entry.owner, entry.job_id) == ("a", job_id)


def test_a_lost_take_held_by_another_owner_since_is_still_a_conflict(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, effects, _ = backend
    ledger.acquire("k", owner="a", lease=LONG)
    effects.lose(ledger, "k")
    assert ledger.acquire("k", owner="b", lease=LONG).outcome == ClaimOutcome.ACQUIRED
    assert not ledger.complete("k", owner="a", result="1")
    with pytest.raises(LedgerConflict), ledger.transaction("k", owner="a") as conn:
        effects.write(conn, "late")
    if effects.settings is not None:
        assert effects.rows() == []
    entry = ledger.get("k")
    assert entry is not None and (entry.state, entry.owner) == (LedgerState.RUNNING, "b")


# -- issue 13 (4, 7): the delivery fence ----------------------------------------


def _job(store: JobStore, key: str) -> Job:
    return store.add_job(new_job(key, store.now() - dt.timedelta(seconds=5)))


@pytest.mark.parametrize(
    "status", [JobStatus.CANCELLED, JobStatus.DEAD, JobStatus.SUCCEEDED, JobStatus.EXPIRED]
)
def test_a_delivery_of_a_finished_or_cancelled_job_is_fenced(
    backend: tuple[Ledger, Effects, JobStore], status: JobStatus
) -> None:
    ledger, _, store = backend
    job = _job(store, "job")
    if status == JobStatus.CANCELLED:
        assert store.cancel("job")
    else:
        assert store.mark_finished(job.id, status)
    claim = ledger.acquire("job", owner="a", lease=LONG, job_id=job.id, attempt=0)
    assert claim.outcome == ClaimOutcome.FENCED
    assert claim.reason == f"the job is {status.value}"
    assert ledger.get("job") is None  # nothing taken
    assert ledger.check_delivery(job.id, 0).reason == claim.reason
    assert ledger.check_delivery(job.id, None).reason == claim.reason


def _requeued(store: JobStore, key: str) -> Job:
    """A job claimed at attempt 0 and requeued by the reconciler (attempt 1)."""
    tracked(store)
    store.add_job(new_job(key, store.now() - dt.timedelta(seconds=5), visibility_timeout=0.01))
    epoch = store.acquire_epoch(0, "test")
    assert len(store.claim_due(shard=0, epoch=epoch, limit=10)) == 1
    time.sleep(0.05)
    store.reconcile(shard=0, epoch=epoch, limit=10, default_visibility_timeout=300)
    requeued = store.get(key)
    assert requeued is not None and requeued.attempt == 1
    assert requeued.status == JobStatus.PENDING
    return requeued


def test_a_delivery_of_an_older_attempt_is_fenced_once_the_job_started(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, _, store = backend
    job = _requeued(store, "job")
    assert store.mark_running(job.id, worker="w1", worker_pid=7)
    stale = ledger.acquire("job", owner="old", lease=LONG, job_id=job.id, attempt=0)
    assert stale.outcome == ClaimOutcome.FENCED
    assert stale.reason == "attempt 0 is older than the job's attempt 1"
    assert stale.adopted is None
    assert ledger.check_delivery(job.id, 0).reason == stale.reason
    assert ledger.get("job") is None
    assert ledger.check_delivery(job.id, 1) == DeliveryCheck()
    current = ledger.acquire("job", owner="new", lease=LONG, job_id=job.id, attempt=1)
    assert current.outcome == ClaimOutcome.ACQUIRED
    assert current.adopted is None


def test_a_delivery_of_a_job_made_due_again_is_checked_against_its_row(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    """A requeue by hand moves a job's due time after its message went out:
    the delivery's ``celery_sched_due`` names no row, and the fence looks the
    job up by the margin instead, telling the delivery the row's due time."""
    ledger, _, store = backend
    job = _job(store, "moved")
    assert store.mark_finished(job.id, JobStatus.DEAD, due_at=job.due_at)
    (requeued,) = store.requeue(["moved"]).requeued
    assert requeued.due_at != job.due_at and requeued.attempt == 1
    check = ledger.check_delivery(job.id, 0, due_at=job.due_at)
    # Nobody started it since: this old copy takes it over, as attempt 2.
    assert (check.reason, check.adopted, check.due_at) == (None, 2, requeued.due_at)
    again = ledger.check_delivery(job.id, 1, due_at=requeued.due_at)
    assert (again.reason, again.due_at) == ("attempt 1 is older than the job's attempt 2", None)


@pytest.mark.parametrize("via", ["check_delivery", "acquire"])
def test_an_older_copy_of_a_job_nobody_started_since_takes_it_over_once(
    backend: tuple[Ledger, Effects, JobStore], via: str
) -> None:
    # The queue was slower than the visibility timeout: the requeued job's
    # first copy arrives before anyone ran it. It runs, as the next attempt;
    # every other copy (older or the requeue's own) is refused after it.
    ledger, _, store = backend
    job = _requeued(store, "job")

    def deliver(owner: str, attempt: int) -> tuple[str | None, int | None]:
        if via == "check_delivery":
            check = ledger.check_delivery(job.id, attempt)
            return check.reason, check.adopted
        claim = ledger.acquire("job", owner=owner, lease=LONG, job_id=job.id, attempt=attempt)
        assert (claim.outcome == ClaimOutcome.FENCED) == (claim.reason is not None)
        return claim.reason, claim.adopted

    assert deliver("first", 0) == (None, 2)
    row = store.get("job")
    assert row is not None
    assert (row.status, row.attempt, row.worker) == (JobStatus.RUNNING, 2, None)
    assert row.started_at is not None
    # A second old copy, and the requeue's own copy, find it started.
    assert deliver("second", 0) == ("attempt 0 is older than the job's attempt 2", None)
    assert deliver("requeued", 1) == ("attempt 1 is older than the job's attempt 2", None)
    # The adopting copy's process names itself when it reports its start.
    assert store.apply_worker_updates(
        [
            WorkerUpdate(
                job_id=job.id, status=JobStatus.RUNNING, worker="w9", worker_pid=9, attempt=2
            )
        ]
    )
    row = store.get("job")
    assert row is not None
    assert (row.status, row.attempt, row.worker, row.worker_pid) == (
        JobStatus.RUNNING,
        2,
        "w9",
        9,
    )


def test_an_adopted_job_whose_process_never_reported_is_rescued(
    backend: tuple[Ledger, Effects, JobStore],
) -> None:
    ledger, _, store = backend
    job = _requeued(store, "job")
    assert ledger.check_delivery(job.id, 0).adopted == 2
    time.sleep(0.05)
    epoch = store.current_epoch(0)
    result = store.rescue(shard=0, epoch=epoch, limit=10, worker_timeout=0.01)
    assert result.rescued == 1
    row = store.get("job")
    assert row is not None
    assert (row.status, row.attempt) == (JobStatus.PENDING, 3)


def test_a_live_or_missing_job_does_not_fence(backend: tuple[Ledger, Effects, JobStore]) -> None:
    ledger, _, store = backend
    job = _job(store, "live")
    assert ledger.check_delivery(job.id, 0) == DeliveryCheck()
    assert ledger.acquire("live", owner="a", lease=LONG, job_id=job.id, attempt=0).outcome == (
        ClaimOutcome.ACQUIRED
    )
    gone = uuid.uuid4()  # pruned, or never a job row: the delivery runs
    assert ledger.check_delivery(gone, 3) == DeliveryCheck()
    claim = ledger.acquire("gone", owner="a", lease=LONG, job_id=gone, attempt=3)
    assert claim.outcome == ClaimOutcome.ACQUIRED
