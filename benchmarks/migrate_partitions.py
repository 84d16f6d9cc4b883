"""How long migration 0012 (the partitioned jobs table) takes per million stored jobs.

Migrates a schema of its own to 0011 (the last unpartitioned layout), loads
``--rows`` jobs server-side (``INSERT ... SELECT generate_series``, a million
per transaction: pending jobs due over the next ``--days`` days, every other
one with a key of its own, the rest keyed by their id), VACUUM ANALYZEs, then
times ``PostgresJobStore.migrate()`` up to 0012: the copy into the
partitions, the index builds, ``job_keys``. Checks that every row arrived,
then DROPs the schema.

    .venv/bin/python benchmarks/migrate_partitions.py [--rows 1000000] [--days 60]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from typing import Any

import psycopg
from _common import PG_URL, emit, load_avg, progress

from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore
from tests.e2e.harness import drop_schema, unique_name

LOAD_BATCH = 1_000_000

LOAD = """
INSERT INTO {schema}.jobs
    (id, key, task, body, content_type, content_encoding, argsrepr, kwargsrepr, due_at,
     due_bucket)
SELECT md5(g::text)::uuid, CASE WHEN g %% 2 = 0 THEN 'order:' || g END, 'tasks.add',
       '\\x5b5b322c20325d2c207b7d2c207b2263616c6c6261636b73223a206e756c6c7d5d'::bytea,
       'application/json', 'utf-8', '(2, 2)', '{{}}',
       due, floor(extract(epoch FROM due) / 60)::int
FROM generate_series(%(start)s::int, %(stop)s::int) AS g,
     LATERAL (SELECT now() + ((g::bigint * 7919) %% %(rows)s::bigint)
                       * (%(span)s::interval / %(rows)s::bigint) AS due) AS d
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=60)
    args = parser.parse_args()
    if args.rows < 1000 or args.days < 1:
        parser.error("--rows must be >= 1000 and --days >= 1")
    schema = unique_name("bench_migrate")
    settings = Settings(database_url=PG_URL, db_schema=schema, statement_timeout=3600.0)
    result: dict[str, Any] = {"rows": args.rows, "days": args.days}
    store = PostgresJobStore(settings)
    try:
        store.migrate("0011")
        with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
            began = time.perf_counter()
            for start in range(1, args.rows + 1, LOAD_BATCH):
                stop = min(start + LOAD_BATCH - 1, args.rows)
                conn.execute(
                    LOAD.format(schema=schema),  # type: ignore[arg-type]
                    {
                        "start": start,
                        "stop": stop,
                        "rows": args.rows,
                        "span": dt.timedelta(days=args.days),
                    },
                )
                progress("loaded %d / %d rows", stop, args.rows)
            conn.execute(f"VACUUM ANALYZE {schema}.jobs")  # type: ignore[arg-type]
            result["load_s"] = round(time.perf_counter() - began, 1)

        began = time.perf_counter()
        store.migrate()
        seconds = time.perf_counter() - began
        with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
            rows = conn.execute(f"SELECT count(*) FROM {schema}.jobs").fetchone()[0]  # type: ignore[arg-type,index]
            keys = conn.execute(f"SELECT count(*) FROM {schema}.job_keys").fetchone()[0]  # type: ignore[arg-type,index]
            parts = conn.execute(
                "SELECT count(*) FROM pg_partition_tree(%s::regclass) WHERE isleaf",
                (f"{schema}.jobs",),
            ).fetchone()[0]  # type: ignore[index]
        if rows != args.rows:
            raise SystemExit(f"migration lost rows: {rows} of {args.rows}")
        result.update(
            migrate_s=round(seconds, 1),
            s_per_million=round(seconds / (args.rows / 1e6), 2),
            job_keys=keys,
            partitions=parts,
        )
        progress("migrated %d rows in %.1f s (%d partitions)", rows, seconds, parts)
    finally:
        store.close()
        drop_schema(PG_URL, schema)
    result["load_avg"] = load_avg()
    emit(result)


if __name__ == "__main__":
    main()
