"""Bulk scheduling throughput: ``Client.schedule_many`` against a raw COPY.

Schedules ``--jobs`` one-off jobs (default 1,000,000) spread evenly over the
next 24 hours through ``Client.schedule_many`` (validation, serialization and
the store's COPY, indexes and all), then COPYs the very same rows with raw
psycopg into a bare table with the same columns and only a primary key: the
physical reference of what PostgreSQL can ingest. Each run uses a fresh
schema; everything is dropped at the end.

    .venv/bin/python benchmarks/bulk_schedule.py [--jobs N] [--runs 3] [--keys] [--profile]

Prints progress, then one JSON object as the last line (medians over runs).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from _common import drop_indexes
from celery import Celery

from celery_sched.client import Client
from celery_sched.models import NewJob
from celery_sched.settings import Settings
from celery_sched.store.postgres import COPY_COLUMNS
from celery_sched.validation import JobBuilder
from tests.e2e.harness import drop_schema, unique_name

DATABASE_URL = os.environ.get(
    "CELERY_SCHED_BENCH_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
TASK = "bench.noop"
TARGET_RATE = 100_000.0
TARGET_RATIO = 0.5


def make_app() -> Celery:
    app = Celery("bench", set_as_current=False)

    @app.task(name=TASK, shared=False)
    def noop(i: int) -> int:
        return i

    return app


def rows(n: int, start: dt.datetime, *, keys: bool = False) -> Iterator[dict[str, Any]]:
    """n jobs spread evenly over 24 hours from ``start``; with ``keys``, each
    with a key of its own (``order:<i>``) instead of its generated id."""
    step = 86_400.0 / n
    delta = dt.timedelta
    for i in range(n):
        row = {"task": TASK, "args": [i], "eta": start + delta(seconds=i * step)}
        if keys:
            row["key"] = f"order:{i}"
        yield row


def copy_tuple(job: NewJob) -> tuple[Any, ...]:
    return (
        job.id,
        job.key,
        job.task,
        job.body,
        job.content_type,
        job.content_encoding,
        job.argsrepr,
        job.kwargsrepr,
        dict(job.options),
        job.due_at,
        job.due_bucket,
        job.expires_at,
        job.max_attempts,
        job.shard,
        job.schedule_id,
        job.visibility_timeout,
        job.max_runtime,
    )


def run_once(
    app: Celery,
    n: int,
    profile: bool,
    index: int,
    without: Sequence[str] = (),
    keys: bool = False,
) -> dict[str, float]:
    schema = unique_name("bench_bulk")
    settings = Settings(database_url=DATABASE_URL, db_schema=schema)
    conninfo = settings.libpq_conninfo()
    start = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    try:
        with Client(app, settings=settings) as client:
            client.migrate()
            drop_indexes(conninfo, schema, without)
            # The caller's input exists before the call; only scheduling is timed.
            inputs = list(rows(n, start, keys=keys))
            profiler = cProfile.Profile() if profile else None
            t0, c0 = time.perf_counter(), time.process_time()
            if profiler is not None:
                profiler.enable()
            written = client.schedule_many(inputs)
            if profiler is not None:
                profiler.disable()
            sched_seconds = time.perf_counter() - t0
            sched_cpu = time.process_time() - c0
            assert written == n, (written, n)
            if profiler is not None:
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
                print(out.getvalue(), file=sys.stderr)

        # The same rows, built outside the timed section.
        builder = JobBuilder(app, settings)
        fixed_now = dt.datetime.now(dt.UTC)
        prepared = [
            copy_tuple(builder.build(r["task"], r["args"], eta=r["eta"], now=lambda: fixed_now))
            for r in inputs
        ]
        del inputs
        columns = ", ".join(f'"{name}"' for name, _ in COPY_COLUMNS)
        with psycopg.connect(conninfo, autocommit=False) as conn:
            conn.execute(f'CREATE TABLE "{schema}".bare (LIKE "{schema}".jobs INCLUDING DEFAULTS)')
            conn.execute(f'ALTER TABLE "{schema}".bare ADD PRIMARY KEY (id)')
            conn.commit()
            t0, c0 = time.perf_counter(), time.process_time()
            with (
                conn.cursor() as cur,
                cur.copy(f'COPY "{schema}".bare ({columns}) FROM STDIN (FORMAT BINARY)') as copy,
            ):
                copy.set_types([kind for _, kind in COPY_COLUMNS])
                write_row = copy.write_row
                for row in prepared:
                    write_row(row)
            conn.commit()
            raw_seconds = time.perf_counter() - t0
            raw_cpu = time.process_time() - c0
        del prepared
    finally:
        drop_schema(conninfo, schema)

    result = {
        "schedule_many_jobs_per_s": n / sched_seconds,
        "raw_copy_jobs_per_s": n / raw_seconds,
        "schedule_many_seconds": sched_seconds,
        "raw_copy_seconds": raw_seconds,
        # Client CPU per row: what the Python side costs; the rest of the
        # wall time is PostgreSQL (or the machine's other load).
        "schedule_many_client_cpu_us_per_job": sched_cpu / n * 1e6,
        "raw_copy_client_cpu_us_per_row": raw_cpu / n * 1e6,
    }
    result["ratio"] = result["schedule_many_jobs_per_s"] / result["raw_copy_jobs_per_s"]
    print(
        f"run {index}: schedule_many {result['schedule_many_jobs_per_s']:,.0f} jobs/s "
        f"({sched_seconds:.2f}s), raw COPY {result['raw_copy_jobs_per_s']:,.0f} rows/s "
        f"({raw_seconds:.2f}s), ratio {result['ratio']:.2f}; client CPU "
        f"{result['schedule_many_client_cpu_us_per_job']:.1f} vs "
        f"{result['raw_copy_client_cpu_us_per_row']:.1f} us/row",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile schedule_many")
    parser.add_argument(
        "--without-index",
        action="append",
        default=[],
        metavar="NAME",
        help="drop this index of the jobs table after migrating (an A/B of its cost)",
    )
    parser.add_argument(
        "--keys", action="store_true", help="give every job a key of its own (order:<i>)"
    )
    args = parser.parse_args()

    app = make_app()
    print(
        f"bulk_schedule: {args.jobs:,} jobs over 24h, {args.runs} run(s), "
        f"{Settings(database_url=DATABASE_URL).safe_database_url}",
        flush=True,
    )
    results = [
        run_once(app, args.jobs, args.profile, i + 1, args.without_index, args.keys)
        for i in range(args.runs)
    ]
    median = {
        key: statistics.median(r[key] for r in results)
        for key in ("schedule_many_jobs_per_s", "raw_copy_jobs_per_s", "ratio")
    }
    summary = {
        "benchmark": "bulk_schedule",
        "jobs": args.jobs,
        "runs": args.runs,
        "without_indexes": args.without_index,
        "keys": args.keys,
        "schedule_many_jobs_per_s": round(median["schedule_many_jobs_per_s"]),
        "raw_copy_jobs_per_s": round(median["raw_copy_jobs_per_s"]),
        "ratio": round(median["ratio"], 3),
        "per_run": [{key: round(value, 3) for key, value in r.items()} for r in results],
        "targets": {"jobs_per_s": TARGET_RATE, "ratio": TARGET_RATIO},
        "meets_targets": median["schedule_many_jobs_per_s"] >= TARGET_RATE
        and median["ratio"] >= TARGET_RATIO,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
