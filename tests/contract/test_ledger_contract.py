"""The idempotency ledger contract, run against every Ledger backend.

Both backends use a real clock (the memory ledger's default clock, Postgres
``now()``), so leases here are short and tests sleep past them.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from celery_sched.errors import LedgerConflict
from celery_sched.interfaces import Ledger
from celery_sched.models import ClaimOutcome, LedgerState
from celery_sched.settings import Settings

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

    def rows(self) -> list[str]:
        if self.settings is None:
            return list(self.memory)
        import psycopg

        with psycopg.connect(self.settings.libpq_conninfo(), autocommit=True) as conn:
            return [
                row[0] for row in conn.execute(f'SELECT k FROM "{self.settings.db_schema}".effects')
            ]


@pytest.fixture(params=["memory", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[tuple[Ledger, Effects]]:
    if request.param == "memory":
        from celery_sched.store.ledger_memory import MemoryLedger

        yield MemoryLedger(), Effects(None)
        return
    from celery_sched.store.ledger_postgres import PostgresLedger
    from celery_sched.store.postgres import PostgresJobStore

    settings: Settings = request.getfixturevalue("settings")
    store = PostgresJobStore(settings)
    store.migrate()
    ledger = PostgresLedger(store)
    yield ledger, Effects(settings)
    ledger.close()
    store.close()


@pytest.fixture
def ledger(backend: tuple[Ledger, Effects]) -> Ledger:
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
    backend: tuple[Ledger, Effects],
) -> None:
    ledger, effects = backend
    ledger.acquire("k", owner="a", lease=LONG)
    with ledger.transaction("k", owner="a") as conn:
        effects.write(conn, "charged")
    assert effects.rows() == ["charged"]
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert ledger.acquire("k", owner="b", lease=LONG).outcome == ClaimOutcome.COMPLETED


def test_transaction_that_raises_leaves_the_key_running(backend: tuple[Ledger, Effects]) -> None:
    ledger, effects = backend
    ledger.acquire("k", owner="a", lease=LONG)
    with pytest.raises(ZeroDivisionError), ledger.transaction("k", owner="a") as conn:
        effects.write(conn, "half-done")
        raise ZeroDivisionError
    if effects.settings is not None:
        assert effects.rows() == []
    entry = ledger.get("k")
    assert entry is not None and entry.state == LedgerState.RUNNING and entry.owner == "a"


def test_transaction_whose_key_was_taken_over_commits_nothing(
    backend: tuple[Ledger, Effects],
) -> None:
    ledger, effects = backend
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
