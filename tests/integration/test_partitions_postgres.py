"""The range-partitioned jobs table (migration 0012) against a real PostgreSQL:
where rows land, global key uniqueness, retention by partition, the
migration of a table with rows in it, and the plans of statements by id."""

from __future__ import annotations

import datetime as dt
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from celery_sched.errors import DuplicateJob
from celery_sched.ids import UUID7Source
from celery_sched.models import JobStatus
from celery_sched.settings import Settings
from celery_sched.store.partitions import parse_name
from celery_sched.store.postgres import PostgresJobStore
from tests.contract.conftest import new_job

pytestmark = pytest.mark.integration

DAY = dt.timedelta(days=1)
HOUR = dt.timedelta(hours=1)


@pytest.fixture
def store(settings: Settings) -> Iterator[PostgresJobStore]:
    backend = PostgresJobStore(settings)
    backend.migrate()
    yield backend
    backend.close()


def raw(settings: Settings) -> psycopg.Connection[Any]:
    return psycopg.connect(settings.libpq_conninfo(), autocommit=True)


def partition_of(settings: Settings, key: str) -> str:
    """The partition holding the job with caller key ``key``."""
    with raw(settings) as conn:
        row = conn.execute(
            f'SELECT tableoid::regclass::text FROM "{settings.db_schema}".jobs WHERE key = %s',
            (key,),
        ).fetchone()
    assert row is not None, key
    return str(row[0]).rsplit(".", 1)[-1].strip('"')


def partitions(settings: Settings) -> list[str]:
    with raw(settings) as conn:
        rows = conn.execute(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
            "WHERE n.nspname = %s AND p.relname = 'jobs' ORDER BY 1",
            (settings.db_schema,),
        ).fetchall()
    return [name for (name,) in rows]


def job_keys(settings: Settings) -> set[str]:
    with raw(settings) as conn:
        rows = conn.execute(f'SELECT key FROM "{settings.db_schema}".job_keys').fetchall()
    return {key for (key,) in rows}


def finish(settings: Settings, keys: list[str], *, finished_ago: dt.timedelta) -> None:
    """Mark the jobs of ``keys`` succeeded ``finished_ago`` before now."""
    with raw(settings) as conn:
        conn.execute(
            f"UPDATE \"{settings.db_schema}\".jobs SET status = 'succeeded', "
            "finished_at = now() - %s WHERE key = ANY(%s)",
            (finished_ago, keys),
        )


def test_rows_land_in_daily_monthly_and_yearly_partitions(
    store: PostgresJobStore, settings: Settings
) -> None:
    now = store.now()
    store.add_job(new_job("tomorrow", now + DAY))
    store.add_job(new_job("in-2030", dt.datetime(2030, 3, 1, 9, tzinfo=dt.UTC)))
    store.load_jobs([new_job("in-100-days", now + 100 * DAY)])
    tomorrow = partition_of(settings, "tomorrow")
    assert parse_name(tomorrow).grain == "day" and parse_name(tomorrow).holds(now + DAY)
    # A far-future job costs one table for its whole year.
    assert partition_of(settings, "in-2030") == "jobs_20300101_20310101"
    assert parse_name(partition_of(settings, "in-100-days")).grain == "month"
    # No DEFAULT partition: only the ranges the rows needed exist.
    assert len(partitions(settings)) == 3
    # The leader's housekeeping makes today and the next week ahead of time.
    store.prepare_storage()
    names = partitions(settings)
    for day in range(8):
        due = now + day * DAY
        assert any(parse_name(name).holds(due) for name in names), (day, names)


def test_a_key_stays_unique_across_partitions(store: PostgresJobStore, settings: Settings) -> None:
    now = store.now()
    first = store.add_job(new_job("order:1", now + DAY))
    # The same key due another day, another month, another year: one job.
    for due in (now + 3 * DAY, now + 90 * DAY, dt.datetime(2031, 1, 1, tzinfo=dt.UTC)):
        with pytest.raises(DuplicateJob) as info:
            store.add_job(new_job("order:1", due))
        assert info.value.key == "order:1"
        assert store.add_job(new_job("order:1", due), if_exists="return") == first
        with pytest.raises(DuplicateJob):
            store.load_jobs([new_job("other", due), new_job("order:1", due)])
    # A key that is a (version 4) UUID's text is kept unique the same way.
    own = uuid.uuid4()
    store.add_job(new_job(str(own), now + DAY, id=own))
    with pytest.raises(DuplicateJob):
        store.add_job(new_job(str(own), now + 40 * DAY, id=own))
    with pytest.raises(DuplicateJob):
        store.load_job_rows([(own, None, *new_job("x", now + 9 * DAY).as_row()[2:])])
    assert store.counts_by_status() == {JobStatus.PENDING: 2}
    assert job_keys(settings) == {"order:1", str(own)}


def test_occurrences_take_free_keys_only_and_a_withdrawal_frees_them(
    store: PostgresJobStore, settings: Settings
) -> None:
    now = store.now()
    jobs = [new_job(f"occ@{i}", now + (i + 1) * DAY) for i in range(3)]
    assert len(store.add_occurrences(jobs)) == 3
    # Planned again (a retried commit) at other due times: nothing is written.
    again = [new_job(f"occ@{i}", now + (i + 5) * DAY) for i in range(3)]
    assert store.add_occurrences(again) == []
    assert store.counts_by_status() == {JobStatus.PENDING: 3}
    assert {f"occ@{i}" for i in range(3)} <= job_keys(settings)


def test_prune_drops_finished_partitions_and_keeps_any_with_an_unfinished_job(
    store: PostgresJobStore, settings: Settings
) -> None:
    now = store.now()
    # Two old days: one all finished, one with a job still pending.
    done_day, busy_day = now - 20 * DAY, now - 18 * DAY
    store.load_jobs(
        [new_job(f"done-{i}", done_day + i * dt.timedelta(minutes=1)) for i in range(5)]
    )
    store.load_jobs(
        [new_job(f"busy-{i}", busy_day + i * dt.timedelta(minutes=1)) for i in range(3)]
    )
    finish(settings, [f"done-{i}" for i in range(5)], finished_ago=10 * DAY)
    finish(settings, ["busy-0", "busy-1"], finished_ago=10 * DAY)
    done_partition, busy_partition = (
        partition_of(settings, "done-0"),
        partition_of(settings, "busy-0"),
    )
    assert done_partition != busy_partition

    pruned = store.prune(older_than=7 * 86400, batch=100)

    assert pruned == 7  # the whole day of 5, and the 2 finished rows of the busy one
    names = partitions(settings)
    assert done_partition not in names and busy_partition in names
    # Nothing lost: the pending job is still there, still due and claimable.
    pending = store.get("busy-2")
    assert pending is not None and pending.status is JobStatus.PENDING
    epoch = store.acquire_epoch(0, "test")
    assert [job.key for job in store.claim_due(shard=0, epoch=epoch, limit=10)] == ["busy-2"]
    # The dropped jobs' keys are free again; a job due that old day recreates its partition.
    assert not {f"done-{i}" for i in range(5)} & job_keys(settings)
    store.add_job(new_job("done-0", done_day))
    assert partition_of(settings, "done-0") == done_partition


def test_a_recent_finish_or_a_young_partition_is_not_dropped(
    store: PostgresJobStore, settings: Settings
) -> None:
    now = store.now()
    store.load_jobs([new_job("late", now - 20 * DAY)])
    finish(settings, ["late"], finished_ago=dt.timedelta(days=1))
    store.add_job(new_job("today", now - dt.timedelta(minutes=1)))
    finish(settings, ["today"], finished_ago=10 * DAY)  # a finished_at far older than its day
    before = partitions(settings)
    # "late" finished a day ago (inside the retention); today's range is not
    # wholly before the cutoff, so its old finished row goes by DELETE.
    assert store.prune(older_than=7 * 86400, batch=100) == 1
    assert partitions(settings) == before
    assert store.get("late") is not None and store.get("today") is None


@pytest.mark.filterwarnings("ignore:Bound parameter 'p_id' rendering literal NULL")
def test_claims_and_reports_by_id_skip_the_partitions_of_later_days(
    store: PostgresJobStore, settings: Settings
) -> None:
    now = store.now()
    store.load_jobs([new_job(f"f{day}", now + day * DAY) for day in range(1, 6)])
    store.add_job(new_job("due", now - dt.timedelta(seconds=1)))
    epoch = store.acquire_epoch(0, "test")
    (claimed,) = store.claim_due(shard=0, epoch=epoch, limit=10)
    # The store's own statement for a message without the due header (one
    # with it names the partition: test_partition_locks_postgres.py), its
    # parameters rendered in (p_id has no value, so it renders as NULL: the
    # id goes in its place).
    statement = store.statements.by_margin.mark_running.values(worker="w@test", worker_pid=1)
    sql = str(
        statement.compile(dialect=store.engine.dialect, compile_kwargs={"literal_binds": True})
    )
    assert sql.count("jobs.id = NULL") == 1, sql
    sql = sql.replace("jobs.id = NULL", f"jobs.id = '{claimed.id}'::uuid")
    with store.engine.begin() as conn:
        plan = "\n".join(
            row[0] for row in conn.exec_driver_sql(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}")
        )
    # The partitions of the next days are pruned when the statement starts.
    assert "Subplans Removed: " in plan, plan
    assert store.get_by_id(claimed.id) is not None
    job = store.get("due")
    assert job is not None and job.status is JobStatus.RUNNING


def test_migration_moves_existing_rows_into_partitions(settings: Settings) -> None:
    """A schema at 0011 with rows (past, today, months ahead, 2030; keyed and
    not) upgrades to partitions with every row, its keys unique after."""
    schema = settings.db_schema
    store = PostgresJobStore(settings)
    store.migrate("0011")
    now = dt.datetime.now(dt.UTC)
    dues = {
        "past": now - 3 * DAY,
        "today": now,
        "months": now + 200 * DAY,
        "far": dt.datetime(2030, 6, 1, tzinfo=dt.UTC),
    }
    keyless = uuid.uuid4()
    with raw(settings) as conn:
        for key, due in [*dues.items(), (None, now + DAY)]:
            conn.execute(
                f'INSERT INTO "{schema}".jobs (id, key, task, body, content_type, '
                "content_encoding, due_at, due_bucket) VALUES (%s, %s, 't', '\\x00', "
                "'application/json', 'utf-8', %s, 0)",
                (keyless if key is None else uuid.uuid4(), key, due),
            )
    try:
        store.migrate()
        assert store.counts_by_status() == {JobStatus.PENDING: 5}
        assert partition_of(settings, "far") == "jobs_20300101_20310101"
        for key, due in dues.items():
            found = store.get(key)
            assert found is not None and found.due_at == due
            assert parse_name(partition_of(settings, key)).holds(due)
            with pytest.raises(DuplicateJob):
                store.add_job(new_job(key, now + 2 * DAY))
        assert store.get(str(keyless)) is not None
        assert job_keys(settings) == set(dues)
    finally:
        store.close()


def test_a_bulk_load_in_any_order_creates_each_partition_once_and_loses_no_row(
    store: PostgresJobStore, settings: Settings
) -> None:
    now = store.now()
    far = [dt.datetime(2031, 1, 1, tzinfo=dt.UTC), dt.datetime(2033, 6, 1, tzinfo=dt.UTC)]
    # Interleaved: each row's partition is missing or another one than the row before's.
    dues = [now + DAY, far[0], now + 2 * DAY, far[1], now + DAY + HOUR, far[0] + HOUR, now]
    keyed = store.load_jobs(new_job(f"mixed-{i}", due) for i, due in enumerate(dues))
    keyless = store.load_job_rows(
        (uuid.uuid4(), None, *new_job("x", due).as_row()[2:]) for due in reversed(dues)
    )
    assert keyed == keyless == len(dues)
    assert store.counts_by_status() == {JobStatus.PENDING: 2 * len(dues)}
    for i, due in enumerate(dues):
        assert parse_name(partition_of(settings, f"mixed-{i}")).holds(due)
    names = partitions(settings)
    assert "jobs_20310101_20320101" in names and "jobs_20330101_20340101" in names
    # Keys of their own and (version 4) ids given as keys are all in job_keys.
    assert len(job_keys(settings)) == 2 * len(dues)


def test_the_look_for_stranded_jobs_in_flight_reads_only_their_indexes(
    store: PostgresJobStore, settings: Settings
) -> None:
    # Shard 0's leader looks every 30 s; reading every partition whole
    # (one "status IN (...)" test matches no partial index) took seconds
    # with millions of future jobs stored.
    now = store.now()
    store.load_jobs(
        [new_job(f"f{i}", now + DAY + i * dt.timedelta(seconds=1)) for i in range(20_000)]
    )
    with raw(settings) as conn:
        conn.execute(f'ANALYZE "{settings.db_schema}".jobs')
    loaded = partition_of(settings, "f0")
    sql = str(store.statements.stranded_in_flight.compile(dialect=store.engine.dialect))
    with raw(settings) as conn:
        rows = conn.execute(f"EXPLAIN (COSTS OFF) {sql}", {"p_shards": 1, "p_limit": 500})
        plan = "\n".join(row[0] for row in rows)
    assert f"Seq Scan on {loaded}" not in plan, plan
    for index in ("jobs_dispatched_idx", "jobs_running_idx", "jobs_retrying_idx"):
        assert f"{index}_" in plan, plan


def test_a_callers_version_7_uuid_key_is_one_job_whatever_the_day(
    store: PostgresJobStore, settings: Settings
) -> None:
    # Version-7 ids take no job_keys entry; one the caller chose as a key is
    # still checked against every partition. Bulk rows keep a caller's key
    # text (JobBuilder.build_row), which tells it from a generated id.
    now = store.now()
    mine = UUID7Source().next()

    def row(due: dt.datetime) -> Any:
        return (mine, str(mine), *new_job(str(mine), due, id=mine).as_row()[2:])

    store.load_job_rows([row(now + DAY)])
    for due in (now + 3 * DAY, now + 90 * DAY):
        with pytest.raises(DuplicateJob):
            store.load_job_rows([new_job("other", due).as_row(), row(due)])
        with pytest.raises(DuplicateJob):
            store.add_job(new_job(str(mine), due, id=mine))
    assert store.counts_by_status() == {JobStatus.PENDING: 1}
    assert job_keys(settings) == {str(mine)}


def test_a_version_7_key_added_alone_holds_its_entry_against_a_later_bulk_load(
    store: PostgresJobStore, settings: Settings
) -> None:
    # add_job of a v7 key (Client.schedule) comes first this time: its
    # entry is what a bulk load of the same key text, another day, meets.
    now = store.now()
    mine = UUID7Source().next()
    first = store.add_job(new_job(str(mine), now + DAY, id=mine))
    assert job_keys(settings) == {str(mine)}
    bulk_row = (mine, str(mine), *new_job(str(mine), now + 5 * DAY, id=mine).as_row()[2:])
    with pytest.raises(DuplicateJob):
        store.load_job_rows([new_job("other", now + 5 * DAY).as_row(), bulk_row])
    assert store.add_job(new_job(str(mine), now + 40 * DAY, id=mine), if_exists="return") == first
    assert store.counts_by_status() == {JobStatus.PENDING: 1}
    assert store.get(str(mine)) == first


def test_a_version_7_key_added_alone_waits_for_a_bulk_load_of_it_in_flight(
    store: PostgresJobStore, settings: Settings
) -> None:
    # A bulk load has written the key's row and entry but not committed (as
    # its COPYs leave them); add_job of the same key, another day, must wait
    # for it and then find the key taken, not look, see nothing and insert.
    now = store.now()
    mine = UUID7Source().next()
    store.ensure_partitions([now + DAY, now + 2 * DAY])
    schema = settings.db_schema
    outcome: list[BaseException | None] = []
    with psycopg.connect(settings.libpq_conninfo()) as bulk:
        bulk.execute(
            f'INSERT INTO "{schema}".jobs (id, key, task, body, content_type, '
            "content_encoding, due_at, due_bucket, max_attempts, shard) "
            "VALUES (%s, %s, 't', '', 'application/json', 'utf-8', %s, 0, 3, 0)",
            (mine, str(mine), now + DAY),
        )
        bulk.execute(f'INSERT INTO "{schema}".job_keys VALUES (%s, %s)', (str(mine), mine))

        def add() -> None:
            try:
                store.add_job(new_job(str(mine), now + 2 * DAY, id=mine))
                outcome.append(None)
            except BaseException as exc:  # the test reads it
                outcome.append(exc)

        adder = threading.Thread(target=add)
        adder.start()
        adder.join(1.0)
        assert adder.is_alive(), outcome  # waiting on the uncommitted entry
        bulk.commit()
    adder.join(10.0)
    assert len(outcome) == 1 and isinstance(outcome[0], DuplicateJob), outcome
    assert store.counts_by_status() == {JobStatus.PENDING: 1}
