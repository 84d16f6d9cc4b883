"""PostgresJobStore against a real PostgreSQL: concurrency, plans, failures, migrations."""

from __future__ import annotations

import dataclasses
import datetime as dt
import gc
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from celery_sched.errors import DuplicateJob, SchemaMissing, StaleEpoch, StoreUnavailable
from celery_sched.models import DueSpan, Job, JobStatus, WorkerUpdate
from celery_sched.settings import Settings
from celery_sched.store.postgres import MIGRATIONS_DIR, PostgresJobStore
from celery_sched.store.schema import build_metadata
from tests.contract.conftest import new_job, tracked
from tests.integration.plans import assert_no_large_partition_read_whole

pytestmark = pytest.mark.integration


def raw_connect(settings: Settings) -> psycopg.Connection[Any]:
    return psycopg.connect(settings.libpq_conninfo(), autocommit=True)


def store_backends(settings: Settings) -> str:
    return f"celery_sched[{settings.db_schema}]"


def test_concurrent_claimers_get_disjoint_sets(store: PostgresJobStore, settings: Settings) -> None:
    due = store.now() - dt.timedelta(seconds=30)
    total = 3000
    store.load_jobs(new_job(f"c{i}", due + dt.timedelta(microseconds=i)) for i in range(total))
    store.load_jobs(new_job(f"f{i}", due + dt.timedelta(days=1, seconds=i)) for i in range(500))
    epoch = store.acquire_epoch(0, "both")
    start = threading.Barrier(2)

    def claimer() -> list[Job]:
        own = PostgresJobStore(settings)
        claimed: list[Job] = []
        start.wait()
        try:
            while batch := own.claim_due(shard=0, epoch=epoch, limit=100):
                claimed.extend(batch)
        finally:
            own.close()
        return claimed

    with ThreadPoolExecutor(2) as pool:
        first, second = (f.result() for f in [pool.submit(claimer), pool.submit(claimer)])
    ids_first = {job.id for job in first}
    ids_second = {job.id for job in second}
    assert len(ids_first) == len(first) and len(ids_second) == len(second)
    assert not ids_first & ids_second
    assert {job.key for job in first + second} == {f"c{i}" for i in range(total)}
    assert first and second, "both claimers should have won some rows"
    assert store.counts_by_status() == {JobStatus.DISPATCHED: total, JobStatus.PENDING: 500}


def test_claim_plan_uses_partial_pending_index(store: PostgresJobStore, settings: Settings) -> None:
    now = store.now()
    # Every row in the day's partition that holds now, whatever the time of
    # day (a claim's plan reads only the partitions up to now): 30,000 jobs
    # already finished, due earlier today, beside 50 due and pending. Only
    # the partial pending index skips the finished ones.
    day = now.astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    since = max(day, now - dt.timedelta(hours=2))
    step = (now - since) / 30_000
    store.load_jobs(new_job(f"done-{i}", since + step * i) for i in range(30_000))
    with raw_connect(settings) as conn:
        conn.execute(
            f"UPDATE \"{settings.db_schema}\".jobs SET status = 'succeeded', "
            "finished_at = now() WHERE key LIKE 'done-%'"
        )
        conn.commit()
    store.load_jobs(new_job(f"due-{i}", max(day, now - dt.timedelta(seconds=i))) for i in range(50))
    with raw_connect(settings) as conn:
        conn.execute(f'ANALYZE "{settings.db_schema}".jobs')
    plan = store.explain_claim(shard=0, limit=1000)
    assert "jobs_pending_due_idx" in plan, plan
    assert "Seq Scan" not in plan, plan
    epoch = store.acquire_epoch(0, "plan")
    assert len(store.claim_due(shard=0, epoch=epoch, limit=1000)) == 50


def test_the_reconciler_reads_retrying_jobs_by_their_partial_index(
    store: PostgresJobStore, settings: Settings
) -> None:
    # Issue 13 (12): the reconciler requeues retries that never started; on
    # a big table that must stay an index range scan, not a table scan.
    now = store.now()
    store.load_jobs(
        new_job(f"r-{i}", now + dt.timedelta(seconds=i), shard=i % 2) for i in range(20_000)
    )
    schema = settings.db_schema
    with raw_connect(settings) as conn:
        conn.execute(
            f"UPDATE \"{schema}\".jobs SET status = 'retrying', "
            "dispatched_at = now() + (random() * 3600) * interval '1 second' "
            "WHERE key LIKE 'r-1%'"
        )
        conn.commit()
        conn.execute(f'ANALYZE "{schema}".jobs')
    compiled = store.statements.requeue_retrying.compile(dialect=store.engine.dialect)
    params = {**compiled.params, "p_shard": 0, "p_limit": 1000, "default_timeout": 300.0}
    with store.engine.connect() as conn:
        plan = "\n".join(
            row[0] for row in conn.exec_driver_sql(f"EXPLAIN {compiled.string}", params)
        )
    assert "jobs_retrying_idx" in plan, plan
    assert_no_large_partition_read_whole(plan, settings)


def test_schema_has_storage_params_and_partial_indexes(
    store: PostgresJobStore, settings: Settings
) -> None:
    # The storage parameters are each partition's (jobs itself has no storage).
    store.add_job(new_job("one", store.now()))
    with raw_connect(settings) as conn:
        reloptions = conn.execute(
            "SELECT c.reloptions FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
            "WHERE n.nspname = %s AND p.relname = 'jobs'",
            (settings.db_schema,),
        ).fetchone()
        indexes: dict[str, str] = dict(
            conn.execute(
                "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = %s",
                (settings.db_schema,),
            ).fetchall()
        )
    assert reloptions is not None
    assert "fillfactor=80" in reloptions[0]
    assert any(opt.startswith("autovacuum_vacuum_scale_factor=") for opt in reloptions[0])
    pending = str(indexes["jobs_pending_due_idx"])
    assert "(shard, due_bucket, due_at)" in pending
    assert "WHERE (status = 'pending'::text)" in pending
    assert "WHERE (status = 'dispatched'::text)" in str(indexes["jobs_dispatched_idx"])
    assert "WHERE (finished_at IS NOT NULL)" in str(indexes["jobs_finished_idx"])


def test_migration_matches_metadata(store: PostgresJobStore, settings: Settings) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    schema = settings.db_schema
    with store.engine.connect() as conn:
        context = MigrationContext.configure(
            conn,
            opts={
                "include_schemas": True,
                # The jobs partitions are made at run time, not by the metadata.
                "include_name": lambda name, type_, parent: (
                    name == schema
                    if type_ == "schema"
                    else type_ != "table" or not re.fullmatch(r"jobs_\d{8}_\d{8}", name or "")
                ),
                "version_table_schema": schema,
            },
        )
        diffs = compare_metadata(context, build_metadata(schema))
    assert diffs == []


def test_schema_missing_before_migrate(settings: Settings) -> None:
    fresh = PostgresJobStore(settings)
    try:
        with pytest.raises(SchemaMissing) as info:
            fresh.get("anything")
        assert "migrate" in str(info.value)
        with pytest.raises(SchemaMissing):
            fresh.claim_due(shard=0, epoch=1, limit=10)
    finally:
        fresh.close()


def test_constructing_a_store_connects_to_nothing() -> None:
    unreachable = Settings(database_url="postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    PostgresJobStore(unreachable).close()


def test_migrate_twice_and_concurrently(settings: Settings) -> None:
    stores = [PostgresJobStore(settings) for _ in range(3)]
    try:
        with ThreadPoolExecutor(3) as pool:
            for future in [pool.submit(s.migrate) for s in stores]:
                future.result()
        stores[0].migrate()
        with raw_connect(settings) as conn:
            versions = conn.execute(
                f'SELECT version_num FROM "{settings.db_schema}".alembic_version'
            ).fetchall()
        # The newest migration in the package, applied once.
        head = max(path.name[:4] for path in (MIGRATIONS_DIR / "versions").glob("0*.py"))
        assert versions == [(head,)]
        stores[1].add_job(new_job("works", stores[1].now()))
        assert stores[2].get("works") is not None
    finally:
        for s in stores:
            s.close()


def test_upgrading_to_0003_keeps_earlier_keys_and_stores_id_keys_once(settings: Settings) -> None:
    """Rows written under 0002 keep their text keys and still answer to them;
    a new job whose key is its id stores NULL, and that key stays unique."""
    schema = settings.db_schema
    early = PostgresJobStore(settings)
    early.migrate("0002")
    early.close()
    old = uuid.uuid4()
    with raw_connect(settings) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".jobs (id, key, task, body, content_type, content_encoding,'
            " due_at, due_bucket) SELECT id, key, 't', '\\x00', 'application/json', 'utf-8',"
            " now() + interval '1 day', 0 FROM (VALUES (%s::uuid, %s), (gen_random_uuid(),"
            " 'caller-key')) AS v (id, key)",
            (old, str(old)),
        )
    store = PostgresJobStore(settings)
    try:
        store.migrate()
        for key in (str(old), "caller-key"):
            found = store.get(key)
            assert found is not None and found.key == key
        with pytest.raises(DuplicateJob):
            store.add_job(new_job(str(old), store.now(), id=old))
        fresh = uuid.uuid4()
        store.add_job(new_job(str(fresh), store.now(), id=fresh))
        with raw_connect(settings) as conn:
            stored = conn.execute(
                f'SELECT key FROM "{schema}".jobs WHERE id = %s', (fresh,)
            ).fetchone()
        assert stored == (None,)
        stored_job = store.get(str(fresh))
        assert stored_job is not None and stored_job.key == str(fresh)
        assert store.counts_by_status() == {JobStatus.PENDING: 3}
    finally:
        store.close()


def test_unreachable_database_raises_store_unavailable_without_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "s3cr3t-pw"
    settings = Settings(
        database_url=f"postgresql+psycopg://postgres:{secret}@127.0.0.1:1/test",
        connect_retries=3,
        retry_backoff=0.01,
    )
    unreachable = PostgresJobStore(settings)
    caplog.set_level(logging.WARNING)
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        unreachable.now()
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert secret not in message
    assert "postgres:***@127.0.0.1:1/test" in message
    retries = [r for r in caplog.records if "attempt" in r.getMessage()]
    assert len(retries) == 2  # attempts 1 and 2 retried, the 3rd raised
    assert all(secret not in record.getMessage() for record in caplog.records)
    unreachable.close()


def test_idle_connections_terminated_are_replaced(
    store: PostgresJobStore, settings: Settings
) -> None:
    store.add_job(new_job("k", store.now()))
    with raw_connect(settings) as conn:
        killed = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (store_backends(settings),),
        ).fetchone()
    assert killed is not None and killed[0] >= 1
    job = store.get("k")
    assert job is not None and job.key == "k"


def test_worker_reports_survive_their_connection_being_terminated(
    store: PostgresJobStore, settings: Settings
) -> None:
    """Status reports run on the hot-path pool, apart from SQLAlchemy's; a
    killed connection is replaced and the batch retried, nothing is lost."""
    store.add_job(new_job("a", store.now() - dt.timedelta(seconds=1)))
    store.add_job(new_job("b", store.now() - dt.timedelta(seconds=1)))
    epoch = store.acquire_epoch(0, "w")
    a, b = sorted(store.claim_due(shard=0, epoch=epoch, limit=10), key=lambda j: j.key)
    report = store.apply_worker_updates
    assert report([WorkerUpdate(job_id=a.id, status=JobStatus.RUNNING, worker="w")]) == 1
    with raw_connect(settings) as conn:
        killed = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = %s",
            (store_backends(settings) + " worker",),
        ).fetchone()
    assert killed is not None and killed[0] == 1
    changed = report(
        [
            WorkerUpdate(job_id=a.id, status=JobStatus.SUCCEEDED),
            WorkerUpdate(job_id=b.id, status=JobStatus.RUNNING, worker="w"),
        ]
    )
    assert changed == 2
    assert store.get_by_id(a.id).status == JobStatus.SUCCEEDED  # type: ignore[union-attr]
    assert store.get_by_id(b.id).status == JobStatus.RUNNING  # type: ignore[union-attr]


def test_connection_terminated_mid_claim_is_retried(
    store: PostgresJobStore, settings: Settings
) -> None:
    quick = PostgresJobStore(dataclasses.replace(settings, retry_backoff=0.05))
    store.add_job(new_job("mid", store.now() - dt.timedelta(seconds=5)))
    epoch = store.acquire_epoch(0, "mid")
    result: list[list[Job]] = []
    errors: list[BaseException] = []

    def claim() -> None:
        try:
            result.append(quick.claim_due(shard=0, epoch=epoch, limit=10))
        except BaseException as exc:
            errors.append(exc)

    with raw_connect(settings) as locker:
        # Hold the leaders row so the claim blocks inside its transaction.
        locker.execute("BEGIN")
        locker.execute(f'SELECT * FROM "{settings.db_schema}".leaders FOR UPDATE')
        thread = threading.Thread(target=claim)
        thread.start()
        deadline = time.monotonic() + 10
        with raw_connect(settings) as admin:
            while True:
                row = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                    "AND wait_event_type = 'Lock'",
                    (store_backends(settings),),
                ).fetchone()
                if row is not None:
                    break
                assert time.monotonic() < deadline, "claim never blocked on the leaders row"
                time.sleep(0.02)
            admin.execute("SELECT pg_terminate_backend(%s)", (row[0],))
        time.sleep(0.1)
        locker.execute("COMMIT")
    thread.join(timeout=20)
    quick.close()
    assert errors == []
    assert [job.key for job in result[0]] == ["mid"]
    assert store.counts_by_status() == {JobStatus.DISPATCHED: 1}


def test_insert_many_streams_a_large_generator(store: PostgresJobStore) -> None:
    due = store.now() + dt.timedelta(days=2)
    produced = 0

    def rows() -> Iterator[object]:
        nonlocal produced
        for i in range(50_000):
            produced += 1
            yield new_job(f"s{i}", due, id=uuid.uuid4())

    assert store.load_jobs(rows()) == 50_000  # type: ignore[arg-type]
    assert produced == 50_000
    assert store.counts_by_status() == {JobStatus.PENDING: 50_000}


def test_claims_decode_options_per_job(store: PostgresJobStore) -> None:
    """Claims read options as text and decode each distinct set once; every
    job still gets its own, equal mapping, nested values included."""
    due = store.now() - dt.timedelta(seconds=5)
    option_sets: list[dict[str, Any]] = [
        {},
        {"queue": "q1", "priority": 3},
        {"queue": "q1", "headers": {"h": ["v", 1]}},
    ]
    expected = {f"o{i}": option_sets[i % 3] for i in range(30)}
    store.load_jobs(
        new_job(key, due + dt.timedelta(microseconds=i), options=options)
        for i, (key, options) in enumerate(expected.items())
    )
    epoch = store.acquire_epoch(0, "t")
    half = store.claim_due(shard=0, epoch=epoch, limit=15)
    rest = store.claim_ids([store.get(k).id for k in expected], shard=0, epoch=epoch)  # type: ignore[union-attr]
    claimed = half + rest
    assert sorted(job.key for job in claimed) == sorted(expected)
    for job in claimed:
        assert job.options == expected[job.key]
        assert job.status is JobStatus.DISPATCHED and job.leader_epoch == epoch
        assert job == store.get(job.key)
    # No two jobs share a mapping (or a nested one) that a caller could mutate.
    nested = [job for job in claimed if "headers" in job.options]
    nested[0].options["headers"]["h"].append("x")  # type: ignore[index]
    assert nested[1].options["headers"] == {"h": ["v", 1]}
    flat = [job for job in claimed if job.options.get("priority") == 3]
    assert flat[0].options is not flat[1].options


def test_bulk_load_options_round_trip(store: PostgresJobStore) -> None:
    due = store.now() + dt.timedelta(hours=1)
    options = {"queue": "é", "headers": {"k": [1, None, True]}, "time_limit": 2.5}
    store.load_jobs([new_job("a", due, options={}), new_job("b", due, options=options)])
    assert store.get("a").options == {}  # type: ignore[union-attr]
    assert store.get("b").options == options  # type: ignore[union-attr]


def test_a_keyed_bulk_load_keeps_nothing_per_key_that_sets_off_the_garbage_collector(
    store: PostgresJobStore,
) -> None:
    """A keyed load keeps its keys' entries until its jobs are in. Before: as
    (key, UUID) pairs, objects the garbage collector tracks, so a load of N
    keyed jobs set off about N/700 collection passes over everything the
    caller held (266 passes, a tenth of the time, for 200k jobs)."""
    due = store.now() + dt.timedelta(hours=1)
    template = new_job("template", due, options={}).as_row()
    count = 20_000

    def rows() -> Iterator[Any]:
        # Each row and its id are made as the client's builder makes them.
        for i in range(count):
            yield (uuid.uuid4(), f"gc-{i}", *template[2:])

    passes = [0]

    def counted(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            passes[0] += 1

    gc.collect()
    gc.callbacks.append(counted)
    try:
        assert store.load_job_rows(rows()) == count
    finally:
        gc.callbacks.remove(counted)
    assert passes[0] <= 5, passes  # 28 or more when each key kept an object
    assert store.get("gc-0") is not None and store.get(f"gc-{count - 1}") is not None


def test_a_claim_retried_after_an_ambiguous_commit_loses_no_row(
    store: PostgresJobStore, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 13: the COMMIT of a claim reaches PostgreSQL but its reply is
    lost; ``Database.transaction`` retries the whole claim, which takes other rows. The first
    claim's rows stay dispatched (nobody publishes them) and the reconciler
    requeues them after their visibility timeout, with an attempt counted."""
    from celery_sched.store.postgres.connection import TransientDatabaseError

    tracked(store)  # a worker tracks the task: the reconciler requeues
    now = store.now()
    for i in range(6):
        store.add_job(
            new_job(f"amb-{i}", now - dt.timedelta(seconds=60 - i), visibility_timeout=0.3)
        )
    epoch = store.acquire_epoch(0, "ambiguous")
    lost: list[Job] = []
    real_guard = store.database.guard

    def guard(fn: Any, what: str) -> Any:
        result = real_guard(fn, what)  # committed
        if what == "claim_due" and not lost:
            lost.extend(result)
            error = psycopg.OperationalError("server closed the connection unexpectedly")
            raise TransientDatabaseError(error)
        return result

    monkeypatch.setattr(store.database, "guard", guard)
    claimed = store.claim_due(shard=0, epoch=epoch, limit=3)
    assert [job.key for job in lost] == ["amb-0", "amb-1", "amb-2"]
    assert [job.key for job in claimed] == ["amb-3", "amb-4", "amb-5"]
    for job in lost:
        stored = store.get_by_id(job.id)
        assert stored is not None
        assert (stored.status, stored.leader_epoch) == (JobStatus.DISPATCHED, epoch)
    time.sleep(0.5)
    result = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=300)
    assert result.requeued == 6  # the lost three and the three never started
    again = store.claim_due(shard=0, epoch=epoch, limit=10)
    assert sorted(job.key for job in again) == [f"amb-{i}" for i in range(6)]
    assert {job.attempt for job in again} == {1}


def test_beat_starts_with_rows_in_shards_that_no_longer_exist_and_warns(
    store: PostgresJobStore, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 13 made beat refuse to start when a lowered celery_sched_shards
    stranded rows; issue 17 moves them instead (shard 0's leader, or
    ``sched reshard``), so beat starts and says so at WARNING."""
    from celery import Celery

    from celery_sched.beat import Scheduler, check_shards

    now = store.now()
    store.add_job(new_job("kept", now - dt.timedelta(seconds=1), shard=0))
    for i in range(3):
        store.add_job(new_job(f"s2-{i}", now + dt.timedelta(hours=i), shard=2))
    store.add_job(new_job("s3", now - dt.timedelta(seconds=1), shard=3))
    epoch = store.acquire_epoch(3, "old fleet")
    assert len(store.claim_due(shard=3, epoch=epoch, limit=5)) == 1
    with caplog.at_level(logging.WARNING, logger="celery_sched.beat"):
        check_shards(store, 4)  # the count they were written with: nothing to say
        assert not caplog.records
        check_shards(store, 2)
    [record] = caplog.records
    message = record.getMessage()
    assert "shard 2: 3 pending" in message and "shard 3: 1 dispatched" in message
    assert "will move them" in message and "sched reshard" in message

    app = Celery("shards_test", set_as_current=False)
    app.conf.update(
        celery_sched_database_url=settings.database_url,
        celery_sched_redis_url=settings.redis_url,
        celery_sched_db_schema=settings.db_schema,
        celery_sched_key_prefix=settings.key_prefix,
        celery_sched_shards=2,
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="celery_sched.beat"):
        scheduler = Scheduler(app)  # a real beat Scheduler: setup_schedule runs the check
    try:
        assert any("shard 2: 3 pending" in r.getMessage() for r in caplog.records)
        assert scheduler._fleet is not None
    finally:
        scheduler.close()


def test_the_shard_check_reads_only_partial_indexes(
    store: PostgresJobStore, settings: Settings
) -> None:
    now = store.now()
    store.load_jobs(
        new_job(f"f-{i}", now + dt.timedelta(seconds=i), shard=i % 2) for i in range(20_000)
    )
    with raw_connect(settings) as conn:
        conn.execute(f'ANALYZE "{settings.db_schema}".jobs')
    with store.engine.connect() as conn:
        compiled = store.statements.unfinished_by_shard.compile(
            dialect=store.engine.dialect, compile_kwargs={"render_postcompile": True}
        )
        params = {k: 2 if k == "from_shard" else v for k, v in compiled.params.items()}
        plan = "\n".join(
            row[0] for row in conn.exec_driver_sql(f"EXPLAIN {compiled.string}", params)
        )
    assert_no_large_partition_read_whole(plan, settings)
    assert "jobs_pending_due_idx" in plan and "jobs_retrying_idx" in plan, plan
    assert store.unfinished_by_shard(from_shard=1) == {1: {JobStatus.PENDING: 10_000}}


def test_a_failover_that_loses_the_last_epoch_bump_never_hands_that_epoch_out_again(
    store: PostgresJobStore, settings: Settings
) -> None:
    """#30 (12): with asynchronous replication a promoted replica can lack
    the last ``acquire_epoch``. The next leader then got the same number as
    the leader of the lost term, which still held it: both passed the fence,
    and the stale one could claim, and release the new leader's claims."""
    now = store.now()
    for key in ("a", "b"):
        store.add_job(new_job(key, now - dt.timedelta(seconds=5)))
    replicated = store.acquire_epoch(0, "beat-1")
    stale = store.acquire_epoch(0, "beat-2")  # committed on the old primary only
    # The promoted replica: the leaders row as it was before beat-2's bump.
    with raw_connect(settings) as conn:
        conn.execute(
            f'UPDATE "{settings.db_schema}".leaders SET epoch = %s, holder = %s WHERE shard = 0',
            (replicated, "beat-1"),
        )
        conn.commit()
    current = store.acquire_epoch(0, "beat-3")
    assert current != stale and current > replicated
    claimed = store.claim_ids([store.get("a").id], shard=0, epoch=current)  # type: ignore[union-attr]
    assert [job.key for job in claimed] == ["a"]
    # The stale leader of the lost term: fenced out of claims, and its
    # release of what it believes it claimed touches nothing of the new term.
    with pytest.raises(StaleEpoch):
        store.claim_due(shard=0, epoch=stale, limit=10)
    due = DueSpan.of([claimed[0].due_at])
    assert store.release([claimed[0].id], epoch=stale, due=due) == 0
    assert store.get("a").status is JobStatus.DISPATCHED  # type: ignore[union-attr]
