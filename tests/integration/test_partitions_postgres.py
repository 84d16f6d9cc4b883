"""The range-partitioned jobs table (migration 0012) against a real PostgreSQL:
where rows land, global key uniqueness, retention by partition, the
migration of a table with rows in it, and the plans of statements by id."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_sched.client import Client
from celery_sched.errors import DuplicateJob, InvalidTime
from celery_sched.ids import UUID7Source
from celery_sched.leader.planning import Planner
from celery_sched.models import JobStatus, NewJobRow
from celery_sched.settings import Settings
from celery_sched.store.partitions import parse_name
from celery_sched.store.postgres import PostgresJobStore, bulk
from tests.contract.conftest import new_job
from tests.integration import cli_app
from tests.integration.plans import assert_no_large_partition_read_whole
from tests.integration.test_cli_schedules import sched

pytestmark = pytest.mark.integration

DAY = dt.timedelta(days=1)
HOUR = dt.timedelta(hours=1)


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
    # Two old days: one all finished, one with a job still pending; their
    # jobs at noon, so that none crosses into the next day's partition.
    noon = store.now().astimezone(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    done_day, busy_day = noon - 20 * DAY, noon - 18 * DAY
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
    sql = str(store.statements.stranded_in_flight.compile(dialect=store.engine.dialect))
    with raw(settings) as conn:
        rows = conn.execute(f"EXPLAIN (COSTS OFF) {sql}", {"p_shards": 1, "p_limit": 500})
        plan = "\n".join(row[0] for row in rows)
    assert_no_large_partition_read_whole(plan, settings)
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


# -- issue #30: partitions that never stall -------------------------------------------


def attach_by_hand(settings: Settings, name: str, lower: str, upper: str) -> None:
    """A partition made outside celery_sched, named ``name``, for ``[lower, upper)``."""
    schema = settings.db_schema
    with raw(settings) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}"."{name}" (LIKE "{schema}".jobs INCLUDING CONSTRAINTS)'
        )
        conn.execute(
            f'ALTER TABLE "{schema}".jobs ATTACH PARTITION "{schema}"."{name}" '
            f"FOR VALUES FROM ('{lower}') TO ('{upper}')"
        )


def test_a_due_time_before_2000_is_refused_by_the_api_and_the_import_and_writes_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    """Before: a job due in year 500 was written, and its partition's name
    (unpadded year) broke every later write (#30, finding 2)."""
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        early = dt.datetime(500, 10, 1, tzinfo=dt.UTC)
        with pytest.raises(InvalidTime, match=r"too early.*2000-01-01T00:00:00\+00:00"):
            client.schedule("cli_app.ping", eta=early)
        with pytest.raises(InvalidTime, match="too early"):
            client.schedule_many(
                [
                    {"task": "cli_app.ping", "key": "fine", "eta": early.replace(year=2030)},
                    {"task": "cli_app.ping", "key": "late", "eta": "1999-12-31T23:59:59Z"},
                ]
            )
        path = tmp_path / "jobs.csv"
        path.write_text(
            "task,key,due\n"
            "cli_app.ping,a,0500-10-01T00:00:00Z\n"
            "cli_app.ping,b,1999-12-31T23:59:59+00:00\n"
        )
        result = sched(
            "import", str(path), schema=settings.db_schema, database_url=settings.database_url
        )
        assert result.returncode == 1, result.stderr
        assert "Read 2 row(s): 0 valid, 0 written, 2 refused." in result.stdout
        assert (
            "line 2: InvalidTime: due time 0500-10-01T00:00:00+00:00 is too early" in result.stdout
        )
        assert (
            "line 3: InvalidTime: due time 1999-12-31T23:59:59+00:00 is too early" in result.stdout
        )
        assert client.store.counts_by_status() == {}
        # (The 2030 row's partition may stay, empty: it was committed apart.)
        assert all(parse_name(name).lower.year >= 2000 for name in partitions(settings))
        # The floor itself is a due time like any other.
        assert client.schedule("cli_app.ping", eta="2000-01-01T00:00:00Z").due_at.year == 2000
        assert "jobs_20000101_20010101" in partitions(settings)


def test_a_stray_partition_is_logged_once_and_left_alone_and_nothing_stalls(
    store: PostgresJobStore, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: the reader parsed every partition's name; one it could not
    parse failed every write, planning and housekeeping, and one it misread
    (year 500's unpadded name read as 5000-10-01 .. 5010-10-01) was taken
    for another range (#30, finding 2)."""
    now = store.now()
    # What a job due in year 500 made before names were fixed width.
    attach_by_hand(settings, "jobs_5000101_5010101", "0500-01-01 00:00+00", "0501-01-01 00:00+00")
    # A name that is not a range at all, and a range that is not its name.
    attach_by_hand(settings, "jobs_archive", "2001-01-01 00:00+00", "2002-01-01 00:00+00")
    attach_by_hand(settings, "jobs_20400101_20410101", "2045-01-01 00:00+00", "2046-01-01 00:00+00")
    strays = {"jobs_5000101_5010101", "jobs_archive", "jobs_20400101_20410101"}
    with raw(settings) as conn:  # an old finished job in a stray, past any retention
        # (Keyless, with a generated v7 id: a row written by hand that would
        # need a job_keys entry is an old writer's, which migration 0014 refuses.)
        conn.execute(
            f'INSERT INTO "{settings.db_schema}".jobs (id, key, task, body, content_type, '
            "content_encoding, due_at, due_bucket, status, finished_at) VALUES (%s, NULL, 't', "
            "'\\x00', 'application/json', 'utf-8', '2001-06-01 00:00+00', 0, 'succeeded', "
            "'2001-06-01 00:01+00')",
            (UUID7Source().next(),),
        )
    caplog.set_level(logging.WARNING, logger="celery_sched.store.postgres.partitioning")
    store.partitions.forget()

    # Scheduling, one job and in bulk (which reads the list afresh), also
    # into a stray's own range (its bounds count: nothing is created over them).
    store.add_job(new_job("soon", now + DAY))
    assert (
        store.load_jobs(
            [
                new_job("bulk", now + 2 * DAY),
                new_job("in-2045", dt.datetime(2045, 6, 1, tzinfo=dt.UTC)),
            ]
        )
        == 2
    )
    assert partition_of(settings, "in-2045") == "jobs_20400101_20410101"
    # Planning.
    client = Client(cli_app.app, settings=settings, store=store, staging=False)
    client.schedules.add("every5", "cli_app.ping", 5)
    assert Planner(store, settings, app=cli_app.app).plan_pass().written
    # Housekeeping: the days ahead are created, and no stray is dropped.
    store.prepare_storage()
    store.prune(older_than=7 * 86400, batch=100)
    names = partitions(settings)
    assert strays <= set(names)
    for day in range(8):
        assert any(parse_name(n).holds(now + day * DAY) for n in names if n not in strays)
    # Each stray named once in the log, however often the list was read.
    logged = [
        r.getMessage() for r in caplog.records if "is not one celery_sched made" in r.getMessage()
    ]
    assert sorted(m.split()[2].split(".")[1] for m in logged) == sorted(strays), logged


def make_store(settings: Settings, **changes: Any) -> PostgresJobStore:
    store = PostgresJobStore(dataclasses.replace(settings, **changes))
    store.migrate()
    return store


def run_threads(targets: list[Callable[[], object]], *, within: float) -> list[object]:
    """Run each target in a thread of its own; each one's result or exception.
    Fails unless all of them end within ``within`` seconds."""
    results: list[object] = [None] * len(targets)
    threads = []
    for i, target in enumerate(targets):

        def run(i: int = i, target: Callable[[], object] = target) -> None:
            try:
                results[i] = target()
            except BaseException as exc:  # the test reads it
                results[i] = exc

        threads.append(threading.Thread(target=run, daemon=True))
    deadline = time.monotonic() + within
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(thread.is_alive() for thread in threads)
    assert not stuck, f"{stuck} of {len(threads)} still running after {within}s: {results}"
    return results


def test_schedules_on_a_cold_partition_cache_never_wait_for_the_pool(settings: Settings) -> None:
    """Before: add_job held a pooled connection and the cold cache's read
    checked out a second one under a lock: with every connection held so,
    all waited for the pool timeout (#30, finding 3)."""
    setup = make_store(settings)
    now = setup.now()
    setup.close()
    # A fresh store: its partition list is cold. Pool 4, timeout 30 s.
    store = PostgresJobStore(dataclasses.replace(settings, pool_max_size=4, statement_timeout=30))
    barrier = threading.Barrier(12)

    def schedule(day: int) -> object:
        barrier.wait()
        return store.add_job(new_job(f"cold-{day}", now + (10 + day) * DAY))

    try:
        results = run_threads([functools.partial(schedule, d) for d in range(12)], within=15)
        assert all(not isinstance(r, BaseException) for r in results), results
        assert store.counts_by_status() == {JobStatus.PENDING: 12}
    finally:
        store.close()


def test_a_bulk_load_in_flight_stalls_no_writer_that_needs_another_new_partition(
    settings: Settings,
) -> None:
    """Before: the load created its partition in its own transaction and held
    the partition lock until it committed: a schedule() needing another new
    partition timed out, and so would the leader's create_ahead (#30, finding 5)."""
    store = make_store(settings, statement_timeout=8)
    other = make_store(settings, statement_timeout=8)  # another process, as it were
    now = store.now()
    started, release = threading.Event(), threading.Event()

    def rows() -> Iterator[NewJobRow]:
        yield new_job("bulk-0", now + 20 * DAY).as_row()  # its partition is created here
        started.set()
        release.wait(30)  # the load's transaction stays open meanwhile
        yield new_job("bulk-1", now + 20 * DAY + HOUR).as_row()

    loaded: list[object] = []
    loader = threading.Thread(target=lambda: loaded.append(store.load_job_rows(rows())))
    loader.start()
    try:
        assert started.wait(10)
        # Each needs a partition of its own, on this store and on another.
        for writer, day in ((store, 25), (other, 27)):
            begun = time.monotonic()
            writer.add_job(new_job(f"alone-{day}", now + day * DAY))
            assert time.monotonic() - begun < 4
        begun = time.monotonic()
        other.prepare_storage()  # the leader's create_ahead: today and 7 days, all new
        assert time.monotonic() - begun < 4
    finally:
        release.set()
        loader.join(30)
        store.close()
        other.close()
    assert loaded == [2]
    check = make_store(settings)
    try:
        assert check.counts_by_status() == {JobStatus.PENDING: 4}
    finally:
        check.close()


def test_a_callers_version_7_key_scheduled_alone_and_in_bulk_at_once_is_one_job(
    settings: Settings,
) -> None:
    """Before: schedule_many COPYed the job row before its key's entry and
    schedule() took the entry first: due the same time, they deadlocked and
    the caller was told PostgreSQL was unavailable (#30, finding 10)."""
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        now = client.store.now()
        ids = UUID7Source()
        # A wide window between the bulk's row and its key: the row first,
        # then many others.
        filler = [{"task": "cli_app.ping", "eta": now + DAY} for _ in range(2000)]
        for round_ in range(15):
            key = str(ids.next())
            due = now + DAY + round_ * dt.timedelta(seconds=1)
            barrier = threading.Barrier(2)

            def single(
                key: str = key, due: dt.datetime = due, barrier: Any = barrier, round_: int = round_
            ) -> object:
                barrier.wait()
                # Into the bulk's window at one point or another.
                time.sleep(round_ * 0.01)
                return client.schedule("cli_app.ping", key=key, eta=due)

            def bulk(key: str = key, due: dt.datetime = due, barrier: Any = barrier) -> object:
                barrier.wait()
                return client.schedule_many(
                    [{"task": "cli_app.ping", "key": key, "eta": due}, *filler]
                )

            one, many = run_threads([single, bulk], within=30)
            if isinstance(many, int):
                assert many == 2001 and isinstance(one, DuplicateJob), (one, many)
            else:
                assert isinstance(many, DuplicateJob) and not isinstance(one, BaseException), (
                    one,
                    many,
                )
            job = client.get(key)
            assert job is not None and str(job.id) == key
            with raw(settings) as conn:
                rows = conn.execute(
                    f'SELECT count(*) FROM "{settings.db_schema}".jobs WHERE id = %s', (job.id,)
                ).fetchone()
            assert rows == (1,)


def test_two_bulk_loads_of_the_same_keys_in_opposite_orders_end_in_one_duplicate(
    settings: Settings,
) -> None:
    """Each load takes its keys' entries in key order, whatever the caller's
    order: the second load waits for the first and is told DuplicateJob.
    Before: each took them in its caller's order, so two loads sharing keys
    in opposite orders, taking them at once, deadlocked and one was told
    PostgreSQL failed (a deadlock), not that its keys were taken."""
    count = 5000
    keys = [f"shared-{i:05d}" for i in range(count)]
    with (
        Client(cli_app.app, settings=settings, staging=False) as first,
        Client(cli_app.app, settings=settings, staging=False) as second,
    ):
        first.migrate()
        due = first.store.now() + DAY
        for round_ in range(3):
            barrier = threading.Barrier(2)
            names = [f"{key}-{round_}" for key in keys]

            def rows(names: list[str], barrier: threading.Barrier = barrier) -> Iterator[Any]:
                for name in names:
                    yield {"task": "cli_app.ping", "key": name, "eta": due}
                # Both loads take their entries at once, once their jobs are in.
                barrier.wait(10)

            up, down = run_threads(
                [
                    lambda names=names, client=first: client.schedule_many(rows(names)),
                    lambda names=names, client=second: client.schedule_many(rows(names[::-1])),
                ],
                within=30,
            )
            outcomes = sorted([up, down], key=lambda outcome: isinstance(outcome, int))
            assert isinstance(outcomes[0], DuplicateJob) and outcomes[1] == count, outcomes
        with raw(settings) as conn:
            stored = conn.execute(
                f'SELECT count(*), count(DISTINCT k.key) FROM "{settings.db_schema}".jobs j '
                f'JOIN "{settings.db_schema}".job_keys k ON k.key = j.key AND k.job_id = j.id'
            ).fetchone()
        assert stored == (3 * count, 3 * count)


def test_a_bulk_load_writes_caller_chosen_ids_after_their_keys_in_bounded_batches(
    store: PostgresJobStore, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rows whose id the caller chose are held back until their keys' entries
    # are in; a segment ends once it holds HELD_ROWS of them (3 here).
    monkeypatch.setattr(bulk, "HELD_ROWS", 3)
    now = store.now()
    ids = UUID7Source()
    chosen: list[uuid.UUID] = []
    rows: list[NewJobRow] = []
    for i in range(8):
        due = now + (1 + i % 3) * DAY  # new partitions mid-way, too
        v4, v7 = uuid.uuid4(), ids.next()
        chosen += [v4, v7]
        rows.append((v4, None, *new_job("x", due).as_row()[2:]))  # a Celery task id
        rows.append((v7, str(v7), *new_job("x", due).as_row()[2:]))  # a v7 key of the caller's
        rows.append(new_job(f"plain-{i}", due).as_row())  # a key of the caller's
        rows.append((ids.next(), None, *new_job("x", due).as_row()[2:]))  # generated
    assert store.load_job_rows(iter(rows)) == len(rows)
    assert store.counts_by_status() == {JobStatus.PENDING: len(rows)}
    assert {str(job_id) for job_id in chosen} <= job_keys(settings)
    # A chosen id taken already still fails the whole load.
    again = [
        new_job("y", now + DAY).as_row(),
        (chosen[0], None, *new_job("z", now + DAY).as_row()[2:]),
    ]
    with pytest.raises(DuplicateJob):
        store.load_job_rows(again)
    assert store.counts_by_status() == {JobStatus.PENDING: len(rows)}
