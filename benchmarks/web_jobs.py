"""How fast the web console's jobs list answers with millions of jobs stored.

Loads ``--rows`` jobs server-side (``INSERT ... SELECT generate_series``, in
transactions of a million) into a schema of its own, ANALYZEs, then times
each list query shape the jobs page sends, through ``Client.list_jobs`` as
the page calls it (51 rows: a page of 50 and one to know a next page
follows): every job, a key prefix, a task, a status (pending, dead), a due
range, and the next page of the task listing. Reports the median of
``--runs`` timings per shape and whether it is under the 200 ms target, then
DROPs the schema.

The year of due times starts 30 days before today by default (daily
partitions around today, then monthly ones, as a live table has them);
``--start YYYY-MM-DD`` moves it (a year from 2031-01-01 is one yearly
partition, the shape the 2026-12-06 re-run first measured).

    .venv/bin/python benchmarks/web_jobs.py [--rows 10000000] [--runs 5] [--start recent]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Callable
from typing import Any

import psycopg
from _common import PG_URL, REDIS_URL, emit, load_avg, median, progress, rounded
from celery import Celery

from celery_sched.client import Client
from celery_sched.models import JobPage, JobQuery, JobStatus
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore
from tests.e2e.harness import drop_schema, unique_name

TARGET_MS = 200.0
LOAD_BATCH = 1_000_000
TASKS = 20


def base_of(start: str) -> dt.datetime:
    """Where the year of due times begins: ``recent`` is 30 days before
    today (past and future days, each in a partition of its own, then
    months: the shape of a live table), or a ``YYYY-MM-DD`` date (one far
    in the future lands in one yearly partition)."""
    if start == "recent":
        today = dt.datetime.now(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        return today - dt.timedelta(days=30)
    return dt.datetime.fromisoformat(start).replace(tzinfo=dt.UTC)


# Due times spread over a year in a shuffled order (a multiplicative step
# modulo the row count), so that insertion order is not due order; 70%
# pending, 25% succeeded, 3% dead, 2% failed.
LOAD = """
INSERT INTO {schema}.jobs
    (id, key, task, body, content_type, content_encoding, due_at, due_bucket, status,
     attempt, finished_at, last_error)
SELECT md5(g::text)::uuid,
       'order/' || lpad(g::text, 9, '0'),
       'tasks.t' || (g %% {tasks}),
       '\\x5b5d'::bytea, 'application/json', 'utf-8',
       due, floor(extract(epoch FROM due) / 60)::int,
       s.status,
       CASE WHEN s.status = 'pending' THEN 0 ELSE 1 END,
       CASE WHEN s.status = 'pending' THEN NULL ELSE due END,
       CASE WHEN s.status IN ('dead', 'failed') THEN 'boom' END
FROM generate_series(%(start)s::int, %(stop)s::int) AS g,
     LATERAL (SELECT %(base)s::timestamptz
                     + ((g::bigint * 7919) %% %(rows)s::bigint)
                       * (interval '1 year' / %(rows)s::bigint)
                     AS due) AS d,
     LATERAL (SELECT CASE WHEN g %% 100 < 70 THEN 'pending'
                          WHEN g %% 100 < 95 THEN 'succeeded'
                          WHEN g %% 100 < 98 THEN 'dead'
                          ELSE 'failed' END AS status) AS s
"""


def load(settings: Settings, rows: int, base: dt.datetime) -> tuple[float, int]:
    """Seconds the load took, and how many partitions hold the rows."""
    began = time.perf_counter()
    # The jobs table is partitioned by due time: make the year's ranges first.
    store = PostgresJobStore(settings)
    try:
        store.ensure_partitions([base, base + dt.timedelta(days=365)])
        store.partitions.forget()
        partitions = len(store.partitions.known())
    finally:
        store.close()
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        for start in range(1, rows + 1, LOAD_BATCH):
            stop = min(start + LOAD_BATCH - 1, rows)
            conn.execute(
                LOAD.format(schema=settings.db_schema, tasks=TASKS),  # type: ignore[arg-type]
                {"start": start, "stop": stop, "base": base, "rows": rows},
            )
            progress("loaded %d / %d rows", stop, rows)
        conn.execute(f"VACUUM ANALYZE {settings.db_schema}.jobs")  # type: ignore[arg-type]
    return time.perf_counter() - began, partitions


def timed(call: Callable[[], JobPage], runs: int) -> tuple[float, int]:
    """Median milliseconds of ``runs`` calls (after one warm-up), and rows returned."""
    page = call()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        page = call()
        times.append((time.perf_counter() - began) * 1000)
    return median(times) or 0.0, len(page.jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--start",
        default="recent",
        help="first due day of the year loaded: 'recent' (30 days ago, the default) or YYYY-MM-DD",
    )
    args = parser.parse_args()
    if args.rows < 1000 or args.runs < 1:
        parser.error("--rows must be >= 1000 and --runs >= 1")
    schema = unique_name("bench_web_jobs")
    settings = Settings(
        database_url=PG_URL, redis_url=REDIS_URL, db_schema=schema, key_prefix=schema
    )
    app = Celery("web_jobs", broker="memory://", set_as_current=False)
    result: dict[str, Any] = {"rows": args.rows, "runs": args.runs, "target_ms": TARGET_MS}
    try:
        with Client(app, settings=settings, staging=False) as client:
            client.migrate()
            base = base_of(args.start)
            load_s, result["partitions"] = load(settings, args.rows, base)
            result["load_s"] = round(load_s, 1)
            progress("%d partitions", result["partitions"])
            mid = base + dt.timedelta(days=180)
            shapes: dict[str, JobQuery] = {
                "all": JobQuery(),
                "prefix": JobQuery(key_prefix="order/0000123"),
                "task": JobQuery(task="tasks.t7"),
                "status_pending": JobQuery(statuses=frozenset({JobStatus.PENDING})),
                "status_dead": JobQuery(statuses=frozenset({JobStatus.DEAD})),
                "due_range": JobQuery(due_after=mid, due_before=mid + dt.timedelta(hours=1)),
                "task_and_status": JobQuery(task="tasks.t15", statuses=frozenset({JobStatus.DEAD})),
            }
            timings: dict[str, Any] = {}
            for name, query in shapes.items():
                ms, count = timed(lambda q=query: client.list_jobs(q, limit=50), args.runs)
                timings[name] = {"ms": rounded(ms, 1), "rows": count}
                progress("%-16s %8.1f ms (%d rows)", name, ms, count)
            first = client.list_jobs(shapes["task"], limit=50)
            ms, count = timed(
                lambda: client.list_jobs(shapes["task"], after=first.next, limit=50), args.runs
            )
            timings["task_next_page"] = {"ms": rounded(ms, 1), "rows": count}
            progress("%-16s %8.1f ms (%d rows)", "task_next_page", ms, count)
            result["timings"] = timings
            result["over_target"] = sorted(
                name for name, t in timings.items() if t["ms"] > TARGET_MS
            )
    finally:
        drop_schema(PG_URL, schema)
    result["load_avg"] = load_avg()
    emit(result)


if __name__ == "__main__":
    main()
