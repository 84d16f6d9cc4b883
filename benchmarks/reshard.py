"""Changing the shard count: how long moving the rows takes, and its WAL.

A fresh schema gets ``--jobs`` pending jobs due over the next month (keyed,
generated server-side, all in shard 0 as a one-shard deployment writes
them). Then, as ``celery -A proj sched reshard`` does it
(:func:`celery_sched.leader.rehoming.reshard`, a batch of ``--batch`` rows
per transaction):

1. **raise** the count 1 -> ``--to`` (default 4): a full pass over every
   unfinished row, moving those whose key hashes elsewhere (3 in 4);
2. **lower** it ``--to`` -> 2: the stranded rows (shards 2 and 3, soonest due
   first), then a full pass.

Each step reports its seconds, rows read and moved, rows moved per second,
seconds per million rows moved, the WAL it wrote (``pg_current_wal_lsn``
before and after; the server's whole WAL, so run it on a quiet server) and
the beat-side (this process's) CPU per row read. Median of ``--runs`` runs.

    .venv/bin/python benchmarks/reshard.py [--jobs 1000000] [--to 4] [--batch 1000] [--runs 3]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from typing import Any

import psycopg
from _common import emit, load_avg, median, progress, rounded

from celery_sched.leader.rehoming import reshard
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore
from celery_sched.validation import shard_of_key
from tests.e2e.harness import drop_schema, unique_name

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"

FUTURE_SQL = """
INSERT INTO "{schema}".jobs (id, key, task, body, content_type, content_encoding,
    argsrepr, kwargsrepr, options, due_at, due_bucket, max_attempts, shard)
SELECT gen_random_uuid(), 'reshard-' || i, 'bench.add', convert_to('[[1, 2], {{}}, {{}}]', 'UTF8'),
    'application/json', 'utf-8', '(1, 2)', '{{}}', '{{"queue": "celery"}}'::jsonb, due,
    floor(extract(epoch FROM due) / 60)::int, 5, 0
FROM (
    SELECT i, now() + interval '1 hour' + (i %% 2592000) * interval '1 second' AS due
    FROM generate_series(1, %(n)s) AS i
) AS g
"""


def wal_lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def step(
    store: PostgresJobStore, conn: psycopg.Connection[Any], *, shards: int, batch: int
) -> dict[str, Any]:
    wal0 = wal_lsn(conn)
    t0, c0 = time.perf_counter(), time.process_time()
    report = reshard(
        store, shards=shards, shard_of=lambda key: shard_of_key(key, shards), batch=batch
    )
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - c0
    wal = wal_lsn(conn) - wal0
    moved = report.moved
    return {
        "to_shards": shards,
        "seconds": round(seconds, 2),
        "rows_read": report.scanned,
        "rows_moved": moved,
        "moved_per_s": round(moved / seconds) if seconds else None,
        "seconds_per_million_moved": round(seconds / moved * 1e6, 1) if moved else None,
        "wal_bytes": wal,
        "wal_bytes_per_moved_row": round(wal / moved) if moved else None,
        "client_cpu_us_per_row_read": round(cpu / report.scanned * 1e6, 2)
        if report.scanned
        else None,
    }


def run_once(url: str, jobs: int, to: int, batch: int, index: int) -> dict[str, Any]:
    schema = unique_name("bench_reshard")
    settings = Settings(database_url=url, db_schema=schema, statement_timeout=600.0)
    store = PostgresJobStore(settings)
    try:
        store.migrate()
        # The jobs table is partitioned by due time: the rows' ranges first.
        now = store.now()
        store.ensure_partitions([now, now + dt.timedelta(days=31)])
        with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
            t0 = time.perf_counter()
            conn.execute(FUTURE_SQL.format(schema=schema), {"n": jobs})
            conn.execute(f'VACUUM ANALYZE "{schema}".jobs')
            store.record_placement(1)
            progress("run %d: %d jobs written in %.1fs", index, jobs, time.perf_counter() - t0)
            raised = step(store, conn, shards=to, batch=batch)
            progress("run %d: 1 -> %d: %s", index, to, raised)
            conn.execute(f'VACUUM ANALYZE "{schema}".jobs')
            lowered = step(store, conn, shards=2, batch=batch)
            progress("run %d: %d -> 2: %s", index, to, lowered)
        return {"raise": raised, "lower": lowered}
    finally:
        store.close()
        drop_schema(settings.libpq_conninfo(), schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--to", type=int, default=4, help="the raised shard count (>= 3)")
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--url", default=os.environ.get("CELERY_SCHED_TEST_DATABASE_URL", DEFAULT_URL)
    )
    ns = parser.parse_args()
    if ns.to < 3:
        parser.error("--to must be at least 3, so that lowering it to 2 strands rows")
    load_start = load_avg()
    runs = [run_once(ns.url, ns.jobs, ns.to, ns.batch, i + 1) for i in range(ns.runs)]

    def med(kind: str, field: str) -> float | None:
        values = [r[kind][field] for r in runs if r[kind][field] is not None]
        return rounded(median(values), 2)

    fields = (
        "seconds",
        "rows_moved",
        "moved_per_s",
        "seconds_per_million_moved",
        "wal_bytes_per_moved_row",
        "client_cpu_us_per_row_read",
    )
    emit(
        {
            "benchmark": "reshard",
            "jobs": ns.jobs,
            "batch": ns.batch,
            "runs": runs,
            "raise": {field: med("raise", field) for field in fields},
            "lower": {field: med("lower", field) for field in fields},
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": load_avg(),
        }
    )


if __name__ == "__main__":
    main()
