"""Bulk scheduling throughput: ``Client.schedule_many`` against a raw COPY.

Schedules ``--jobs`` one-off jobs (default 1,000,000) spread evenly over the
next 24 hours through ``Client.schedule_many`` (validation, serialization and
the store's COPY, indexes and all), then COPYs the very same rows with raw
psycopg into a bare table with the same columns and only a primary key: the
physical reference of what PostgreSQL can ingest. Each load uses a fresh
schema; everything is dropped at the end.

With ``--keys`` (bar A3, issue #31 target 5) each run schedules the load
twice, each time into a fresh schema: once with a caller key per job
(``order:<i>``) and once without, in alternating order from run to run, and
reports the keyed rate, the keyless rate and their ratio from the same run
(target: keyed >= 100,000 jobs/s and >= 0.9x keyless).

Beside each rate: the client's CPU per job (this process) and PostgreSQL's
backend CPU per job (the backends the load's connections ran on, read from
``/proc`` between checkout and checkin; the ANALYZE after the load
included, autovacuum not).

    .venv/bin/python benchmarks/bulk_schedule.py [--jobs N] [--runs 3] [--keys] [--profile]
    .venv/bin/python benchmarks/bulk_schedule.py --jobs 200000 --keys   # target 5 of #31

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
from sqlalchemy import event

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
#: --keys: keyed jobs/s at least TARGET_RATE and at least this times keyless.
TARGET_KEYED_RATIO = 0.9
_TICK = os.sysconf("SC_CLK_TCK")


def backend_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, None if unreadable
    (PostgreSQL on another machine)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK


class BackendMeter:
    """PostgreSQL backend CPU spent by the connections an engine checks out:
    each connection's backend CPU is read at checkout and at checkin."""

    def __init__(self, engine: Any) -> None:
        self.seconds = 0.0
        self.readable = True
        self._open: dict[int, float] = {}
        self._engine = engine
        event.listen(engine, "checkout", self._checkout)
        event.listen(engine, "checkin", self._checkin)

    def _checkout(self, dbapi_conn: Any, record: Any, proxy: Any) -> None:
        pid = dbapi_conn.info.backend_pid
        cpu = backend_cpu(pid)
        if cpu is None:
            self.readable = False
        else:
            self._open[id(record)] = cpu

    def _checkin(self, dbapi_conn: Any, record: Any) -> None:
        start = self._open.pop(id(record), None)
        if start is None or dbapi_conn is None:
            return
        cpu = backend_cpu(dbapi_conn.info.backend_pid)
        if cpu is not None:
            self.seconds += cpu - start

    def close(self) -> None:
        event.remove(self._engine, "checkout", self._checkout)
        event.remove(self._engine, "checkin", self._checkin)

    def per_job_us(self, n: int) -> float | None:
        return self.seconds / n * 1e6 if self.readable else None


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


def schedule_load(
    app: Celery,
    n: int,
    start: dt.datetime,
    *,
    keys: bool,
    profile: bool,
    without: Sequence[str] = (),
) -> dict[str, float | None]:
    """``Client.schedule_many`` of ``n`` jobs into a fresh schema, timed."""
    schema = unique_name("bench_bulk")
    settings = Settings(database_url=DATABASE_URL, db_schema=schema)
    conninfo = settings.libpq_conninfo()
    try:
        with Client(app, settings=settings) as client:
            client.migrate()
            drop_indexes(conninfo, schema, without)
            # The caller's input exists before the call; only scheduling is timed.
            inputs = list(rows(n, start, keys=keys))
            meter = BackendMeter(client.store.engine)  # type: ignore[attr-defined]
            profiler = cProfile.Profile() if profile else None
            t0, c0 = time.perf_counter(), time.process_time()
            if profiler is not None:
                profiler.enable()
            written = client.schedule_many(inputs)
            if profiler is not None:
                profiler.disable()
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - c0
            meter.close()
            assert written == n, (written, n)
            if profiler is not None:
                out = io.StringIO()
                pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
                print(out.getvalue(), file=sys.stderr)
    finally:
        drop_schema(conninfo, schema)
    return {
        "jobs_per_s": n / seconds,
        "seconds": seconds,
        # Client CPU per job: what the Python side costs; backend CPU per job:
        # what PostgreSQL's side costs (None when its /proc is not readable).
        "client_cpu_us_per_job": cpu / n * 1e6,
        "backend_cpu_us_per_job": meter.per_job_us(n),
    }


def raw_copy(app: Celery, n: int, start: dt.datetime) -> dict[str, float | None]:
    """The same keyless rows COPYed with raw psycopg into a bare table (the
    columns of jobs, only a primary key), built outside the timed section."""
    schema = unique_name("bench_bulk")
    settings = Settings(database_url=DATABASE_URL, db_schema=schema)
    conninfo = settings.libpq_conninfo()
    try:
        with Client(app, settings=settings) as client:
            client.migrate()
        builder = JobBuilder(app, settings)
        fixed_now = dt.datetime.now(dt.UTC)
        prepared = [
            copy_tuple(builder.build(r["task"], r["args"], eta=r["eta"], now=lambda: fixed_now))
            for r in rows(n, start)
        ]
        columns = ", ".join(f'"{name}"' for name, _ in COPY_COLUMNS)
        with psycopg.connect(conninfo, autocommit=False) as conn:
            conn.execute(f'CREATE TABLE "{schema}".bare (LIKE "{schema}".jobs INCLUDING DEFAULTS)')
            conn.execute(f'ALTER TABLE "{schema}".bare ADD PRIMARY KEY (id)')
            conn.commit()
            pid = conn.info.backend_pid
            b0 = backend_cpu(pid)
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
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - c0
            b1 = backend_cpu(pid)
        del prepared
    finally:
        drop_schema(conninfo, schema)
    return {
        "jobs_per_s": n / seconds,
        "seconds": seconds,
        "client_cpu_us_per_job": cpu / n * 1e6,
        "backend_cpu_us_per_job": None if b0 is None or b1 is None else (b1 - b0) / n * 1e6,
    }


def _us(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def run_once(
    app: Celery,
    n: int,
    profile: bool,
    index: int,
    without: Sequence[str] = (),
    keys: bool = False,
) -> dict[str, float | None]:
    start = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    loads: dict[str, dict[str, float | None]] = {}
    # With --keys, both loads in this run, first one then the other in
    # turn from run to run (neither always meets a warmer or busier server).
    order = [False, True] if index % 2 else [True, False]
    for keyed in order if keys else [False]:
        name = "keyed" if keyed else "keyless"
        loads[name] = schedule_load(app, n, start, keys=keyed, profile=profile, without=without)
    raw = raw_copy(app, n, start)
    plain = loads["keyless"]
    result: dict[str, float | None] = {
        "schedule_many_jobs_per_s": plain["jobs_per_s"],
        "raw_copy_jobs_per_s": raw["jobs_per_s"],
        "schedule_many_seconds": plain["seconds"],
        "raw_copy_seconds": raw["seconds"],
        "schedule_many_client_cpu_us_per_job": plain["client_cpu_us_per_job"],
        "schedule_many_backend_cpu_us_per_job": plain["backend_cpu_us_per_job"],
        "raw_copy_client_cpu_us_per_row": raw["client_cpu_us_per_job"],
        "raw_copy_backend_cpu_us_per_row": raw["backend_cpu_us_per_job"],
    }
    result["ratio"] = plain["jobs_per_s"] / raw["jobs_per_s"]  # type: ignore[operator]
    line = (
        f"run {index}: schedule_many {plain['jobs_per_s']:,.0f} jobs/s "
        f"({plain['seconds']:.2f}s, client {_us(plain['client_cpu_us_per_job'])}, "
        f"backend {_us(plain['backend_cpu_us_per_job'])} us/job)"
    )
    if keys:
        keyed = loads["keyed"]
        result.update(
            {
                "keyed_jobs_per_s": keyed["jobs_per_s"],
                "keyed_seconds": keyed["seconds"],
                "keyed_client_cpu_us_per_job": keyed["client_cpu_us_per_job"],
                "keyed_backend_cpu_us_per_job": keyed["backend_cpu_us_per_job"],
                "keyed_ratio": keyed["jobs_per_s"] / plain["jobs_per_s"],  # type: ignore[operator]
                "keyed_raw_ratio": keyed["jobs_per_s"] / raw["jobs_per_s"],  # type: ignore[operator]
            }
        )
        line += (
            f", with keys {keyed['jobs_per_s']:,.0f} jobs/s ({keyed['seconds']:.2f}s, client "
            f"{_us(keyed['client_cpu_us_per_job'])}, backend "
            f"{_us(keyed['backend_cpu_us_per_job'])} us/job), keyed/keyless "
            f"{result['keyed_ratio']:.2f}"
        )
    line += (
        f"; raw COPY {raw['jobs_per_s']:,.0f} rows/s (client "
        f"{_us(raw['client_cpu_us_per_job'])}, backend {_us(raw['backend_cpu_us_per_job'])} "
        f"us/row), ratio {result['ratio']:.2f}"
    )
    print(line, flush=True)
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
        "--keys",
        action="store_true",
        help="also load every job with a key of its own (order:<i>) and report keyed/keyless",
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

    def median_of(key: str) -> float | None:
        values = [r[key] for r in results if r.get(key) is not None]
        return statistics.median(values) if values else None  # type: ignore[type-var]

    def rounded(value: float | None, digits: int) -> float | None:
        return None if value is None else round(value, digits)

    median = {key: median_of(key) for key in results[0]}
    rate, ratio = median["schedule_many_jobs_per_s"], median["ratio"]
    assert rate is not None and ratio is not None
    summary: dict[str, Any] = {
        "benchmark": "bulk_schedule",
        "jobs": args.jobs,
        "runs": args.runs,
        "without_indexes": args.without_index,
        "keys": args.keys,
        "schedule_many_jobs_per_s": round(rate),
        "raw_copy_jobs_per_s": rounded(median["raw_copy_jobs_per_s"], 0),
        "ratio": round(ratio, 3),
        "client_cpu_us_per_job": rounded(median["schedule_many_client_cpu_us_per_job"], 2),
        "backend_cpu_us_per_job": rounded(median["schedule_many_backend_cpu_us_per_job"], 2),
        "per_run": [{key: rounded(value, 3) for key, value in r.items()} for r in results],
    }
    if args.keys:
        keyed, keyed_ratio = median["keyed_jobs_per_s"], median["keyed_ratio"]
        assert keyed is not None and keyed_ratio is not None
        summary.update(
            {
                "keyed_jobs_per_s": round(keyed),
                "keyless_jobs_per_s": round(rate),
                "keyed_ratio": round(keyed_ratio, 3),
                "keyed_client_cpu_us_per_job": rounded(median["keyed_client_cpu_us_per_job"], 2),
                "keyed_backend_cpu_us_per_job": rounded(median["keyed_backend_cpu_us_per_job"], 2),
                "keyed_raw_ratio": rounded(median["keyed_raw_ratio"], 3),
                "targets": {"keyed_jobs_per_s": TARGET_RATE, "keyed_ratio": TARGET_KEYED_RATIO},
                "meets_targets": keyed >= TARGET_RATE and keyed_ratio >= TARGET_KEYED_RATIO,
            }
        )
    else:
        summary["targets"] = {"jobs_per_s": TARGET_RATE, "ratio": TARGET_RATIO}
        summary["meets_targets"] = rate >= TARGET_RATE and ratio >= TARGET_RATIO
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
