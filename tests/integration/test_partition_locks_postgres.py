"""Statements by job id lock one partition of the jobs table, however many
there are (issue #30, finding 4).

A statement that names a job by id only (or bounds its due time by
``now()``) is planned over every partition, and PostgreSQL locks each one
and each of its indexes: about 13 locks per partition, 1,700 with the 133
partitions made here, where a server's shared lock table holds
``max_locks_per_transaction`` (64 by default) per connection. Concurrent
worker reports then failed with "out of shared memory", for every user of
the server. Each test counts the relations the store's own statements hold
locked at the end of their transaction (its statements run as the store
runs them: prepared or not, again and again past psycopg's prepare
threshold).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import Connection

from celery_sched.errors import CelerySchedError
from celery_sched.models import DueSpan, Job, JobStatus, WorkerUpdate
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore, PostgresLedger
from celery_sched.store.postgres.connection import Database
from tests.contract.conftest import new_job
from tests.e2e import harness

pytestmark = pytest.mark.integration

DAY = dt.timedelta(days=1)
#: More than the 100 partitions of the finding: daily ones for a month each
#: side of today, monthly ones for a year each side, yearly ones to 2045.
MANY_PARTITIONS = 100
#: Runs of each statement: past psycopg's prepare threshold (5) and the
#: sixth run, where PostgreSQL plans a prepared statement generically once.
RUNS = 8

_LOCKED = """
SELECT coalesce(t.relname, c.relname)
FROM pg_locks l
JOIN pg_class c ON c.oid = l.relation
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_index i ON i.indexrelid = c.oid
LEFT JOIN pg_class t ON t.oid = i.indrelid
WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND n.nspname = %s
"""


@pytest.fixture(scope="module")
def schema(pg_url: str) -> Iterator[str]:
    """One schema for the module: making 133 partitions takes a while."""
    name = harness.unique_name("locks")
    yield name
    # One partition per transaction first: a DROP SCHEMA ... CASCADE of them
    # all locks every partition and index at once, which a server's shared
    # lock table may not hold beside other sessions' locks.
    with psycopg.connect(Settings(database_url=pg_url).libpq_conninfo(), autocommit=True) as conn:
        children = conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s "
            "AND c.relkind IN ('r', 'p')",
            (name,),
        ).fetchall()
        for (child,) in children:
            conn.execute(f'DROP TABLE IF EXISTS "{name}"."{child}"')
    harness.drop_schema(pg_url, name)


@pytest.fixture(scope="module")
def module_settings(pg_url: str, schema: str) -> Settings:
    return Settings(database_url=pg_url, db_schema=schema)


@pytest.fixture(scope="module")
def partitioned(module_settings: Settings) -> Iterator[PostgresJobStore]:
    store = PostgresJobStore(module_settings)
    store.migrate()
    now = store.now()
    store.ensure_partitions([now - 400 * DAY, now + 400 * DAY])
    store.ensure_partitions([now + 400 * DAY, dt.datetime(2045, 1, 1, tzinfo=dt.UTC)])
    yield store
    store.close()


@pytest.fixture
def store(partitioned: PostgresJobStore) -> PostgresJobStore:
    assert len(partitioned.partitions.known()) > MANY_PARTITIONS
    return partitioned


def dispatched(store: PostgresJobStore, key: str, count: int = 1) -> list[Job]:
    """``count`` jobs due a second ago, claimed by a leader of shard 0."""
    now = store.now()
    for i in range(count):
        store.add_job(new_job(f"{key}-{i}", now - dt.timedelta(seconds=1)))
    epoch = store.acquire_epoch(0, "test")
    claimed = store.claim_due(shard=0, epoch=epoch, limit=count)
    assert len(claimed) == count
    return claimed


def count_locks(database: Database, schema: str) -> list[list[str]]:
    """From now on, each hot-path call and transaction of ``database`` runs
    in one transaction whose locked relations of ``schema`` (a table, or
    the table of a locked index) are recorded before it commits."""
    seen: list[list[str]] = []

    def counted_raw(run: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(what: str, fn: Callable[[psycopg.Cursor[Any]], Any]) -> Any:
            def in_transaction(cur: psycopg.Cursor[Any]) -> Any:
                with cur.connection.transaction():
                    result = fn(cur)
                    with cur.connection.cursor() as look:
                        seen.append([name for (name,) in look.execute(_LOCKED, (schema,))])
                return result

            return run(what, in_transaction)

        return wrapped

    transaction = database.transaction

    def counted_transaction(what: str, fn: Callable[[Connection], Any]) -> Any:
        def locked(conn: Connection) -> Any:
            result = fn(conn)
            rows = conn.exec_driver_sql(_LOCKED, (schema,)).all()
            seen.append([name for (name,) in rows])
            return result

        return transaction(what, locked)

    database.run_raw = counted_raw(database.run_raw)  # type: ignore[method-assign]
    database.run_raw_once = counted_raw(database.run_raw_once)  # type: ignore[method-assign]
    database.transaction = counted_transaction  # type: ignore[method-assign]
    return seen


def partitions_locked(seen: list[list[str]]) -> set[str]:
    """The partitions of jobs (``jobs_<range>``) any recorded transaction locked."""
    return {name for names in seen for name in names if name.startswith("jobs_")}


def partition_of(store: PostgresJobStore, job: Job) -> str:
    (rng,) = [rng for rng in store.partitions.known() if rng.holds(job.due_at)]
    return rng.name


#: Relations a statement on one job may lock: its partition and the parent
#: table (each with its indexes, counted as their table), the ledger.
MOST_LOCKS = 40


def test_a_worker_report_locks_only_its_jobs_partition(store: PostgresJobStore) -> None:
    jobs = dispatched(store, "report", count=RUNS)
    seen = count_locks(store.database, store.settings.db_schema)
    for job in jobs:
        # One report per flush (a worker running one task at a time), each
        # naming the due time its message carries.
        started = WorkerUpdate(
            job_id=job.id, status=JobStatus.RUNNING, worker="w", worker_pid=1, due_at=job.due_at
        )
        done = WorkerUpdate(job_id=job.id, status=JobStatus.SUCCEEDED, due_at=job.due_at)
        for report in (started, done):
            assert store.apply_worker_updates([report]) == 1
    assert len(seen) == 2 * RUNS
    assert partitions_locked(seen) == {partition_of(store, jobs[0])}
    assert max(len(names) for names in seen) <= MOST_LOCKS, seen
    assert {store.get(job.key).status for job in jobs} == {JobStatus.SUCCEEDED}  # type: ignore[union-attr]


def test_a_delivery_fence_check_and_a_ledger_take_lock_only_their_jobs_partition(
    store: PostgresJobStore,
) -> None:
    ledger = PostgresLedger(store)
    jobs = dispatched(store, "fence", count=RUNS)
    # The ledger reads the partitions' listing once (a catalog read, cached).
    ledger.check_delivery(jobs[0].id, jobs[0].attempt, due_at=jobs[0].due_at)
    seen = count_locks(store.database, store.settings.db_schema)
    for job in jobs:
        check = ledger.check_delivery(job.id, job.attempt, due_at=job.due_at)
        assert check.reason is None and check.due_at is None
    for job in jobs:
        claim = ledger.acquire(
            job.key, owner=f"o-{job.key}", lease=30, job_id=job.id, attempt=0, due_at=job.due_at
        )
        assert claim.outcome.value == "acquired"
    assert len(seen) == 2 * RUNS
    assert partitions_locked(seen) == {partition_of(store, jobs[0])}
    assert max(len(names) for names in seen) <= MOST_LOCKS, seen


def test_a_leader_release_locks_only_its_jobs_partitions(store: PostgresJobStore) -> None:
    seen = count_locks(store.database, store.settings.db_schema)
    for run in range(RUNS):
        jobs = dispatched(store, f"release-{run}", count=3)
        del seen[:]  # the claim's own transactions
        epoch = store.current_epoch(0)
        due = DueSpan.of(job.due_at for job in jobs)
        assert store.release([job.id for job in jobs], epoch=epoch, due=due) == 3
        assert partitions_locked(seen) == {partition_of(store, jobs[0])}
        assert max(len(names) for names in seen) <= MOST_LOCKS, seen
        for job in jobs:
            store.cancel(job.key)


def test_fifty_concurrent_reports_fit_the_default_lock_table(
    store: PostgresJobStore, module_settings: Settings
) -> None:
    """50 reports in flight at once, on a server with the default
    max_locks_per_transaction (64): none runs out of shared memory.

    Each report is held at its row (another transaction has it locked)
    after it took its relation locks, so all 50 hold theirs at the same
    time. Tried once each: a retry would only hide the failure as latency.
    """
    with psycopg.connect(module_settings.libpq_conninfo(), autocommit=True) as admin:
        row = admin.execute("SHOW max_locks_per_transaction").fetchone()
    assert row is not None and int(row[0]) <= 64, "the server's lock table is larger than stock"
    reporters = 50
    jobs = dispatched(store, "crowd", count=reporters)
    once = PostgresJobStore(
        Settings(
            database_url=module_settings.database_url,
            db_schema=module_settings.db_schema,
            pool_max_size=reporters,
            connect_retries=1,
        )
    )
    errors: list[BaseException] = []
    results: list[int] = []

    def report(job: Job) -> None:
        update = WorkerUpdate(
            job_id=job.id, status=JobStatus.RUNNING, worker="w", worker_pid=1, due_at=job.due_at
        )
        try:
            results.append(once.apply_worker_updates([update]))
        except CelerySchedError as exc:
            errors.append(exc)

    table = f'"{module_settings.db_schema}".jobs'
    threads = [threading.Thread(target=report, args=(job,)) for job in jobs]
    try:
        with psycopg.connect(module_settings.libpq_conninfo()) as holder:
            holder.execute(
                f"SELECT 1 FROM {table} WHERE id = ANY(%s) FOR UPDATE",
                ([job.id for job in jobs],),
            )
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 60
            with psycopg.connect(module_settings.libpq_conninfo(), autocommit=True) as watch:
                while time.monotonic() < deadline:
                    row = watch.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND application_name LIKE %s",
                        (f"celery_sched[{module_settings.db_schema}]%",),
                    ).fetchone()
                    waiting = 0 if row is None else int(row[0])
                    if waiting + len(errors) >= reporters:
                        break
                    time.sleep(0.05)
            holder.rollback()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        once.close()
    assert errors == []
    assert sorted(results) == [1] * reporters
    assert {store.get(job.key).status for job in jobs} == {JobStatus.RUNNING}  # type: ignore[union-attr]


def test_a_claim_locks_no_partition_of_a_later_day(store: PostgresJobStore) -> None:
    """A claim's partition bound is the fence's now() (the transaction's
    start, which every now() of the claim reads too): tomorrow's partition,
    which holds a day of future jobs, is neither planned nor locked (issue
    #31; with a bound of now plus a day it was in every claim's plan)."""
    now = store.now()
    store.load_jobs(new_job(f"later-{day}", now + day * DAY) for day in range(1, 4))
    epoch = store.acquire_epoch(0, "test")
    seen = count_locks(store.database, store.settings.db_schema)
    for run in range(RUNS):
        store.add_job(new_job(f"horizon-{run}", store.now() - dt.timedelta(seconds=1)))
        del seen[:]
        (claimed,) = store.claim_due(shard=0, epoch=epoch, limit=10)
        assert claimed.key == f"horizon-{run}"
        after = store.now()
        held = {rng.name: rng for rng in store.partitions.known()}
        locked = partitions_locked(seen)
        assert partition_of(store, claimed) in locked
        assert all(held[name].lower <= after for name in locked), sorted(locked)
