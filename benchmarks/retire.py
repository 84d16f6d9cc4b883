"""What retiring finished jobs costs: time and WAL, and bytes per stored job.

Loads ``--rows`` finished jobs server-side (``INSERT ... SELECT
generate_series``, a million per transaction) into a schema of its own, due
and finished over the ``--days`` days that ended a week ago, then retires
everything older than three days:

- ``--method prune`` (default): the store's own ``prune``, as the leader's
  housekeeping calls it (``celery_sched_prune_batch`` rows per batch);
- ``--method delete``: the batched DELETE that ``prune`` ran before the jobs
  table was partitioned (one statement per ``--batch`` rows, each its own
  transaction), for comparison on the same table.

Reports the seconds, the WAL written (``pg_current_wal_lsn`` before and after,
after a CHECKPOINT: other sessions' writes on the same server count too, so
run it on a quiet server) and the rows left; before retiring, the bytes the
jobs table and its indexes take per stored job (``pg_partition_tree`` sums
every partition of a partitioned table; ``job_keys`` is counted when it exists). Then DROPs the
schema.

    .venv/bin/python benchmarks/retire.py [--rows 10000000] [--method prune|delete]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from typing import Any

import psycopg
from _common import PG_URL, REDIS_URL, emit, load_avg, progress
from celery import Celery

from celery_sched.client import Client
from celery_sched.settings import Settings
from tests.e2e.harness import drop_schema, unique_name

LOAD_BATCH = 1_000_000
RETENTION = dt.timedelta(days=3)

# Due times spread evenly over the days that ended a week ago, in a shuffled
# order (a multiplicative step modulo the row count); each job finished one
# second after it was due. The body is a small Celery protocol 2 body.
LOAD = """
INSERT INTO {schema}.jobs
    (id, task, body, content_type, content_encoding, argsrepr, kwargsrepr, due_at, due_bucket,
     status, attempt, dispatched_at, started_at, finished_at, worker)
SELECT md5(g::text)::uuid, 'tasks.add',
       '\\x5b5b322c20325d2c207b7d2c207b2263616c6c6261636b73223a206e756c6c7d5d'::bytea,
       'application/json', 'utf-8', '(2, 2)', '{{}}',
       due, floor(extract(epoch FROM due) / 60)::int,
       'succeeded', 1, due, due, due + interval '1 second', 'celery@bench'
FROM generate_series(%(start)s::int, %(stop)s::int) AS g,
     LATERAL (SELECT %(first)s::timestamptz
                     + ((g::bigint * 7919) %% %(rows)s::bigint)
                       * (%(span)s::interval / %(rows)s::bigint) AS due) AS d
"""

# The statement prune ran per batch before partitioning (0001 to 0010).
BATCHED_DELETE = """
DELETE FROM {schema}.jobs WHERE id IN (
    SELECT id FROM {schema}.jobs
    WHERE finished_at < now() - make_interval(secs => %(older_than)s)
    LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
"""

SIZE = """
SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint
FROM (SELECT relid FROM pg_partition_tree(%(table)s::regclass)
      UNION SELECT %(table)s::regclass) AS parts
"""


def table_bytes(conn: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    sizes = {"jobs": conn.execute(SIZE, {"table": f"{schema}.jobs"}).fetchone()[0]}  # type: ignore[index]
    exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (f"{schema}.job_keys",))
    if exists.fetchone()[0]:  # type: ignore[index]
        sizes["job_keys"] = conn.execute(SIZE, {"table": f"{schema}.job_keys"}).fetchone()[0]  # type: ignore[index]
    return sizes


def wal_lsn(conn: psycopg.Connection[Any]) -> str:
    return str(conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0])  # type: ignore[index]


def wal_since(conn: psycopg.Connection[Any], lsn: str) -> int:
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)::bigint", (lsn,))
    return int(row.fetchone()[0])  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--days", type=int, default=10)
    parser.add_argument("--method", choices=("prune", "delete"), default="prune")
    parser.add_argument("--batch", type=int, default=5000, help="rows per DELETE (--method delete)")
    args = parser.parse_args()
    if args.rows < 1000 or args.days < 1:
        parser.error("--rows must be >= 1000 and --days >= 1")
    schema = unique_name("bench_retire")
    settings = Settings(
        database_url=PG_URL, redis_url=REDIS_URL, db_schema=schema, key_prefix=schema
    )
    app = Celery("retire", broker="memory://", set_as_current=False)
    now = dt.datetime.now(dt.UTC)
    last = dt.datetime(now.year, now.month, now.day, tzinfo=dt.UTC) - dt.timedelta(days=7)
    first = last - dt.timedelta(days=args.days)
    result: dict[str, Any] = {"rows": args.rows, "days": args.days, "method": args.method}
    try:
        with Client(app, settings=settings, staging=False) as client:
            client.migrate()
            store: Any = client.store
            # A partitioned table takes rows only into ranges that exist.
            ensure = getattr(store, "ensure_partitions", None)
            if ensure is not None:
                ensure([first, last - dt.timedelta(microseconds=1)])
            with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
                began = time.perf_counter()
                for start in range(1, args.rows + 1, LOAD_BATCH):
                    stop = min(start + LOAD_BATCH - 1, args.rows)
                    conn.execute(
                        LOAD.format(schema=schema),  # type: ignore[arg-type]
                        {
                            "start": start,
                            "stop": stop,
                            "first": first,
                            "rows": args.rows,
                            "span": last - first,
                        },
                    )
                    progress("loaded %d / %d rows", stop, args.rows)
                conn.execute(f"VACUUM ANALYZE {schema}.jobs")  # type: ignore[arg-type]
                result["load_s"] = round(time.perf_counter() - began, 1)
                sizes = table_bytes(conn, schema)
                result["bytes"] = sizes
                result["bytes_per_job"] = round(sum(sizes.values()) / args.rows, 1)
                progress("stored: %s bytes per job", result["bytes_per_job"])

                conn.execute("CHECKPOINT")
                lsn = wal_lsn(conn)
                began = time.perf_counter()
                older_than = RETENTION.total_seconds()
                if args.method == "prune":
                    retired = store.prune(older_than=older_than, batch=settings.prune_batch)
                else:
                    retired = 0
                    statement = BATCHED_DELETE.format(schema=schema)
                    while True:
                        cursor = conn.execute(
                            statement,  # type: ignore[arg-type]
                            {"older_than": older_than, "batch": args.batch},
                        )
                        retired += cursor.rowcount
                        if cursor.rowcount < args.batch:
                            break
                        if retired % 1_000_000 < args.batch:
                            progress("deleted %d rows", retired)
                result["retire_s"] = round(time.perf_counter() - began, 2)
                result["wal_bytes"] = wal_since(conn, lsn)
                result["retired"] = retired
                left = conn.execute(f"SELECT count(*) FROM {schema}.jobs")  # type: ignore[arg-type]
                result["rows_left"] = left.fetchone()[0]  # type: ignore[index]
                progress(
                    "retired %d rows in %.1f s, %.1f MB of WAL",
                    retired,
                    result["retire_s"],
                    result["wal_bytes"] / 1e6,
                )
    finally:
        drop_schema(PG_URL, schema)
    result["load_avg"] = load_avg()
    emit(result)


if __name__ == "__main__":
    main()
