"""Claim throughput of PostgresJobStore with many future jobs in the table.

For each future-row count (default 1,000,000 then 5,000,000) a fresh schema is
loaded with that many future jobs (all sizes first); then, ``--rounds`` times,
each size in turn gets ``--due`` jobs due now, is vacuumed and analyzed, and
is drained with ``claim_due`` in batches of ``--batch`` (interleaved rounds:
a drift of the machine's speed hits every size alike; rates are medians over
rounds). The claim
rate must not depend on how many future rows there are (the partial pending
index is scanned from the oldest due row and stops at the current minute).

Each size is measured with one claim loop, then with as many concurrent loops
as a leading beat keeps in flight (``celery_sched.leader.sweeping.CLAIMS_AHEAD``; each
loop claims on its own connection, SKIP LOCKED keeps their rows apart); fresh
due rows are loaded for each. The target applies to the beat's way of claiming.

The due jobs are keyless by default (their key is their id, as for
``Client.schedule`` without ``key=``); ``--keys`` gives each one a key of its
own, which every claim then also writes into the key index.

Each size is loaded twice, into the ``jobs`` table as migrated (partitioned
by due time, 0012) and into a reference schema whose ``jobs`` is one plain
table with the same columns and indexes (the layout before 0012; the same
store and claim statements run on it), and every measurement runs on both
in turn: the printed ratio partitioned / unpartitioned is taken within one
run and round (issue #31, target 3: at least 1.0, and 70k rows/s with the
beat's loops). The reference lacks only what no claim touches: the
partitions, and 0014's AFTER INSERT trigger. The ratio grows with the
future: at 10M future jobs the plain table's indexes outgrow the cache and
its claims slow down, where a partition's stay small.

The PostgreSQL server's CPU per claimed row is the CPU time (utime + stime in
``/proc/<pid>/stat``; the server must run on this machine) of the backends
of the store's connections (found by their ``application_name``) over the
claim loops, divided by the rows claimed: planning, execution, the epoch
fence and the commits; not autovacuum (issue #31, target 2: at most 6 us).

Usage: .venv/bin/python benchmarks/claim.py [--future 1000000 5000000] [--due 100000]
    [--claimers 1 3] [--keys] [--rounds 1] [--layouts partitioned unpartitioned]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from _common import drop_indexes

from celery_sched.ids import UUID7Source
from celery_sched.leader.sweeping import CLAIMS_AHEAD
from celery_sched.models import NewJob
from celery_sched.settings import Settings
from celery_sched.store.partitions import PartitionRange
from celery_sched.store.postgres import PostgresJobStore
from celery_sched.store.postgres.connection import WRITER_REVISION, WRITER_SETTING
from celery_sched.store.postgres.partitioning import _Listing
from celery_sched.store.schema import JOBS_STORAGE
from tests.e2e.harness import drop_schema, unique_name

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BODY = b'[[1, 2], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'


FUTURE_SQL = """
INSERT INTO "{schema}".jobs (id, key, task, body, content_type, content_encoding,
    argsrepr, kwargsrepr, options, due_at, due_bucket, max_attempts, shard)
SELECT gen_random_uuid(), 'future-' || i, 'bench.add', convert_to('[[1, 2], {{}}, {{}}]', 'UTF8'),
    'application/json', 'utf-8', '(1, 2)', '{{}}', '{{"queue": "celery"}}'::jsonb, due,
    floor(extract(epoch FROM due) / 60)::int, 5, 0
FROM (
    SELECT i, now() + interval '1 day' + (i %% 2592000) * interval '1 second' AS due
    FROM generate_series(%(first)s::int, %(last)s::int) AS i
) AS g
"""

#: The layouts of ``jobs`` measured: as migrated, and the plain reference.
LAYOUTS = ("partitioned", "unpartitioned")
#: Issue #31, target 3: rows/s with the beat's claim loops at every size, and
#: the partitioned table's rate against the plain table's.
TARGET_ROWS_PER_S = 70_000
TARGET_RATIO = 1.0
#: Issue #31, target 2: PostgreSQL server CPU per claimed row.
TARGET_SERVER_US = 6.0

#: Future rows generated per statement (one transaction each).
FUTURE_CHUNK = 2_000_000


def jobs(
    count: int, start: dt.datetime, spread: dt.timedelta, *, keys: bool = False
) -> Iterator[NewJob]:
    """Due jobs as ``Client.schedule`` makes them: a time-ordered (UUIDv7) id,
    which is also the key unless ``keys`` gives each job a key of its own
    (then every claim also writes an entry into the key index). The ids
    matter: a claim writes each row's new version into the primary key, and
    v7 ids of jobs scheduled together sit on neighbouring index pages
    (random v4 ids measured ~30% more server time per claimed row)."""
    step = spread / max(count, 1)
    options = {"queue": "celery"}
    ids = UUID7Source()
    for i in range(count):
        job_id = ids.next()
        yield NewJob(
            id=job_id,
            key=f"due-{job_id}" if keys else str(job_id),
            task="bench.add",
            body=BODY,
            content_type="application/json",
            content_encoding="utf-8",
            argsrepr="(1, 2)",
            kwargsrepr="{}",
            due_at=start + step * i,
            options=options,
        )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def claim_all(
    store: PostgresJobStore, epoch: int, batch: int, claimers: int
) -> tuple[int, float, float, list[float]]:
    """Drain every due row with ``claimers`` concurrent claim loops (threads,
    each claim on its own pooled connection, as a leading beat's sweep runs
    them); return rows, seconds, this process's CPU seconds, batch latencies."""
    latencies: list[float] = []
    counts: list[int] = []
    lock = threading.Lock()

    def loop() -> None:
        claimed = 0
        mine: list[float] = []
        while True:
            t0 = time.perf_counter()
            got = store.claim_due(shard=0, epoch=epoch, limit=batch)
            if not got:
                break
            mine.append(time.perf_counter() - t0)
            claimed += len(got)
        with lock:
            latencies.extend(mine)
            counts.append(claimed)

    cpu_started = time.process_time()
    started = time.perf_counter()
    threads = [threading.Thread(target=loop) for _ in range(claimers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return sum(counts), elapsed, time.process_time() - cpu_started, latencies


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def backend_cpu(conninfo: str, schema: str) -> dict[int, float]:
    """CPU seconds so far of each backend serving the store of ``schema``
    (its connections are named ``celery_sched[<schema>]``)."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        pids = [
            row[0]
            for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                (f"celery_sched[{schema}]"[:63],),
            )
        ]
    cpu: dict[int, float] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # utime and stime are fields 14 and 15 of the whole line.
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return cpu


def unpartition(conninfo: str, schema: str) -> None:
    """Replace the migrated, partitioned ``jobs`` of ``schema`` by one plain
    table with the same columns, defaults, constraints, storage parameters
    and indexes, the indexes under the same names (the reference layout;
    ``--without-index`` drops the same index from both)."""
    storage = ", ".join(f"{name} = {value}" for name, value in JOBS_STORAGE.items())
    table = f'"{schema}".jobs'
    with psycopg.connect(conninfo, autocommit=True) as conn, conn.transaction():
        indexes = conn.execute(
            "SELECT c.relname, pg_get_indexdef(i.indexrelid), i.indisprimary FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = %s::regclass",
            (table,),
        ).fetchall()
        conn.execute(f"ALTER TABLE {table} RENAME TO jobs_partitioned")
        conn.execute(
            f'CREATE TABLE {table} (LIKE "{schema}".jobs_partitioned '
            f"INCLUDING ALL EXCLUDING INDEXES) WITH ({storage})"
        )
        conn.execute(f'DROP TABLE "{schema}".jobs_partitioned CASCADE')
        for name, definition, primary in indexes:
            conn.execute(definition.replace(" ON ONLY ", " ON "))
            if primary:
                conn.execute(
                    f'ALTER TABLE {table} ADD CONSTRAINT "{name}" PRIMARY KEY USING INDEX "{name}"'
                )


#: Every due time, as the partition list of the reference's plain table.
_EVERYTHING = PartitionRange(
    lower=dt.datetime(1970, 1, 1, tzinfo=dt.UTC), upper=dt.datetime(9000, 1, 1, tzinfo=dt.UTC)
)


class Sized:
    """One schema holding ``future`` future rows, with a leader epoch to claim under."""

    def __init__(self, url: str, future: int, without: Sequence[str], layout: str) -> None:
        self.future = future
        self.layout = layout
        self.schema = unique_name("bench_claim")
        self.settings = Settings(database_url=url, db_schema=self.schema, statement_timeout=600.0)
        self.store = PostgresJobStore(self.settings)
        self.store.migrate()
        if layout == "unpartitioned":
            unpartition(self.settings.libpq_conninfo(), self.schema)
            # Nothing to create: every due time has its (one) table.
            self.store.partitions._read = lambda conn: _Listing(  # type: ignore[method-assign]
                own=[], held=[_EVERYTHING]
            )
            self.store.partitions.forget()
        drop_indexes(self.settings.libpq_conninfo(), self.schema, without)
        started = time.perf_counter()
        # A partitioned jobs table takes rows only into ranges that exist.
        ensure = getattr(self.store, "ensure_partitions", None)
        now = self.store.now()
        if ensure is not None and layout == "partitioned":
            ensure([now + dt.timedelta(days=1), now + dt.timedelta(days=31)])
        with psycopg.connect(self.settings.libpq_conninfo(), autocommit=True) as conn:
            # The future rows are filler: generate them server-side, which is
            # far faster than streaming millions of rows from Python. They
            # start a day ahead so that even a slow load never makes them due.
            # Written as this code writes (0014's trigger checks the rows of
            # writers that do not say their revision).
            conn.execute(f"SET {WRITER_SETTING} = '{WRITER_REVISION}'")
            for done in range(0, future, FUTURE_CHUNK):
                conn.execute(
                    FUTURE_SQL.format(schema=self.schema),
                    {"first": done + 1, "last": min(done + FUTURE_CHUNK, future)},
                )
        self.future_seconds = time.perf_counter() - started
        self.epoch = self.store.acquire_epoch(0, "bench")

    def measure(self, due: int, batch: int, count: int, keys: bool) -> dict[str, Any]:
        """Load ``due`` fresh due rows and drain them with ``count`` claim loops."""
        now = self.store.now()
        started = time.perf_counter()
        # The due rows go through the real bulk path (COPY via load_jobs).
        loaded = self.store.load_jobs(
            jobs(due, now - dt.timedelta(minutes=10), dt.timedelta(minutes=9), keys=keys)
        )
        load_seconds = time.perf_counter() - started
        with psycopg.connect(self.settings.libpq_conninfo(), autocommit=True) as conn:
            conn.execute(f'VACUUM ANALYZE "{self.schema}".jobs')
        print(
            f"future={self.future:,}: generated future rows in {self.future_seconds:.1f}s; "
            f"load_jobs {loaded:,} rows in {load_seconds:.1f}s "
            f"({loaded / load_seconds:,.0f} rows/s)",
            file=sys.stderr,
        )
        conninfo = self.settings.libpq_conninfo()
        # The pool's connections exist from the load on; one more may open.
        server_before = backend_cpu(conninfo, self.schema)
        claimed, elapsed, cpu, latencies = claim_all(self.store, self.epoch, batch, count)
        server_after = backend_cpu(conninfo, self.schema)
        server = sum(t - server_before.get(pid, 0.0) for pid, t in server_after.items())
        if claimed != due:
            raise SystemExit(f"claimed {claimed} rows, expected {due}")
        result = {
            "layout": self.layout,
            "future_rows": self.future,
            "due_rows": due,
            "batch": batch,
            "claimers": count,
            "claimed": claimed,
            "seconds": round(elapsed, 3),
            "rows_per_s": round(claimed / elapsed),
            # This process's CPU (row loading into Jobs); the rest is the server's.
            "client_cpu_us_per_row": round(cpu / claimed * 1e6, 2),
            # The backends serving the claims (planning, execution, fence, commit).
            "server_cpu_us_per_row": round(server / claimed * 1e6, 2),
            "p50_ms": round(statistics.median(latencies) * 1000, 2),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
            "insert_many_rows_per_s": round(loaded / load_seconds),
        }
        print(
            f"{self.layout} future={self.future:,}, {count} claimer(s): claimed {claimed:,} in "
            f"{elapsed:.2f}s = {result['rows_per_s']:,} rows/s, server "
            f"{result['server_cpu_us_per_row']} us/row, client "
            f"{result['client_cpu_us_per_row']} us/row, p50 {result['p50_ms']} ms, "
            f"p99 {result['p99_ms']} ms per batch of {batch}",
            file=sys.stderr,
        )
        return result

    def close(self) -> None:
        self.store.close()
        drop_schema(self.settings.libpq_conninfo(), self.schema)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--future", type=int, nargs="+", default=[1_000_000, 5_000_000])
    parser.add_argument("--due", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every size this many times, interleaved (sizes are loaded once); "
        "rates are medians over rounds",
    )
    parser.add_argument(
        "--keys",
        action="store_true",
        help="give every due job a key of its own (default: keyless, the key is the id)",
    )
    parser.add_argument(
        "--claimers",
        type=int,
        nargs="+",
        default=[1, CLAIMS_AHEAD],
        help="concurrent claim loops, each count measured in turn (default: 1, then as many "
        "as a leading beat keeps in flight)",
    )
    parser.add_argument(
        "--url", default=os.environ.get("CELERY_SCHED_TEST_DATABASE_URL", DEFAULT_URL)
    )
    parser.add_argument(
        "--without-index",
        action="append",
        default=[],
        metavar="NAME",
        help="drop this index of the jobs table after migrating (an A/B of its cost)",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=LAYOUTS,
        default=list(LAYOUTS),
        help="the jobs tables to measure (default both: the ratio needs both)",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    # Every size and layout is loaded first; then each round measures every
    # size, claimer count and layout in turn, so a drift of the machine's
    # speed hits all alike.
    sized: list[Sized] = []
    runs: list[dict[str, Any]] = []
    try:
        for future in args.future:
            for layout in args.layouts:
                sized.append(Sized(args.url, future, args.without_index, layout))
        for round_ in range(args.rounds):
            for future in args.future:
                for count in args.claimers:
                    for size in sized:
                        if size.future == future:
                            result = size.measure(args.due, args.batch, count, args.keys)
                            runs.append(result | {"round": round_ + 1})
    finally:
        for size in sized:
            size.close()
    print(json.dumps(summarize(args, runs)))


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per layout, size and claimer count; the ratios
    partitioned / unpartitioned taken within each round, then their median."""
    summary: dict[str, Any] = {
        "benchmark": "claim",
        "due_jobs_have_keys": args.keys,
        "without_indexes": args.without_index,
        "rounds": args.rounds,
        "runs": runs,
    }
    most = max(args.claimers)
    summary["claimers_as_the_beat"] = most

    def of(layout: str, future: int, count: int) -> list[dict[str, Any]]:
        return [
            r
            for r in runs
            if r["layout"] == layout and r["future_rows"] == future and r["claimers"] == count
        ]

    table: dict[str, Any] = {}
    for layout in args.layouts:
        table[layout] = {
            str(future): {
                str(count): {
                    "rows_per_s": round(statistics.median(r["rows_per_s"] for r in rs)),
                    "server_cpu_us_per_row": round(
                        statistics.median(r["server_cpu_us_per_row"] for r in rs), 2
                    ),
                    "client_cpu_us_per_row": round(
                        statistics.median(r["client_cpu_us_per_row"] for r in rs), 2
                    ),
                }
                for count in args.claimers
                if (rs := of(layout, future, count))
            }
            for future in args.future
        }
    summary["medians"] = table
    main_layout = args.layouts[0]
    rates = {str(f): table[main_layout][str(f)][str(most)]["rows_per_s"] for f in args.future}
    summary["layout"] = main_layout
    summary["rows_per_s"] = rates
    summary["server_cpu_us_per_row"] = {
        str(f): table[main_layout][str(f)][str(most)]["server_cpu_us_per_row"] for f in args.future
    }
    checks = [rate >= TARGET_ROWS_PER_S for rate in rates.values()]
    checks += [us <= TARGET_SERVER_US for us in summary["server_cpu_us_per_row"].values()]
    if {"partitioned", "unpartitioned"} <= set(args.layouts):
        ratios: dict[str, dict[str, float]] = {}
        for future in args.future:
            for count in args.claimers:
                per_round = [
                    p["rows_per_s"] / u["rows_per_s"]
                    for p, u in zip(
                        of("partitioned", future, count),
                        of("unpartitioned", future, count),
                        strict=True,
                    )
                ]
                ratios.setdefault(str(future), {})[str(count)] = round(
                    statistics.median(per_round), 3
                )
        summary["ratio_partitioned_vs_unpartitioned"] = ratios
        checks += [r >= TARGET_RATIO for by_count in ratios.values() for r in by_count.values()]
    if len(args.future) >= 2:
        first, last = str(args.future[0]), str(args.future[-1])
        summary["rate_ratio_last_vs_first"] = round(rates[last] / rates[first], 3)
    summary["target_rows_per_s"] = TARGET_ROWS_PER_S
    summary["target_ratio"] = TARGET_RATIO
    summary["target_server_cpu_us_per_row"] = TARGET_SERVER_US
    summary["meets_target"] = all(checks)
    return summary


if __name__ == "__main__":
    main()
