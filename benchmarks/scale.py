"""Throughput across beats: 16 shards shared by 1, 2 and 4 identical beats.

For each beat count (``--beats``, default 1 2 4) and each of ``--runs`` runs,
interleaved (1, 2, 4, 1, 2, 4, ...), on a fresh schema with
``celery_sched_shards = --shards``:

1. the beats are started (``celery -A legacy_app beat -S celery_sched``, no
   pinned shard) and the test waits until every shard has a leader and the
   spread is within one (the beats have balanced);
2. ``--jobs`` jobs due ``--lead`` seconds later are written with
   ``Client.schedule_many`` (spread over the shards by key hash);
3. the beats publish them to a Redis queue nobody consumes. The rate is
   ``jobs / (last arrival - first arrival)`` on the broker side (queue depth
   sampled every 20 ms), and the beat CPU per job is the CPU time of every
   beat process over that window divided by the jobs.

On this 2-core machine the beats, PostgreSQL, Redis and the sampler share two
cores: more beats measure contention, not scale-out. The README's "Scaling
out" gives the model for N machines from the per-job costs measured here.

    .venv/bin/python benchmarks/scale.py [--jobs 200000] [--runs 3] [--beats 1 2 4]
        [--shards 16] [--lead 8]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from typing import Any

from _common import (
    CpuSampler,
    QueueDepth,
    Run,
    arrival_rate,
    arrival_window,
    emit,
    load_avg,
    median,
    progress,
    rounded,
    watch_depth,
)
from legacy_app import TASK, app

from celery_sched.client import Client


def balanced(run: Run, shards: int, beats: int, since: float) -> bool:
    """Every shard has a leader elected after ``since`` and the holders'
    counts are within one (from the ``leaders`` table, which the epoch bump
    writes)."""
    try:
        rows = run.query(
            "SELECT holder, count(*) FROM {s}.leaders "
            "WHERE acquired_at > to_timestamp(%s) GROUP BY holder",
            since,
        )
    except Exception:
        return False
    counts = [int(count) for _holder, count in rows]
    return len(counts) == beats and sum(counts) == shards and max(counts) - min(counts) <= 1


def one_run(ns: argparse.Namespace, beats: int, index: int) -> dict[str, Any]:
    run = Run("scale", broker="redis", shards=ns.shards, batch_size=ns.batch_size)
    try:
        with Client(app, settings=run.settings) as client:
            client.migrate()
        started = time.time()
        procs = [run.start_beat(f"beat{n}") for n in range(beats)]
        deadline = time.monotonic() + 60
        while not balanced(run, ns.shards, beats, started - 1):
            if time.monotonic() > deadline:
                raise SystemExit(f"{beats} beats did not balance:\n{procs[0].tail()}")
            time.sleep(0.2)
        balance_s = time.time() - started
        depth = QueueDepth(run.broker, run.queue)
        cpus = [CpuSampler(proc.pid) for proc in procs]
        try:
            due = time.time() + ns.lead
            eta = dt.datetime.fromtimestamp(due, dt.UTC)
            with Client(app, settings=run.settings) as client:
                written = client.schedule_many(
                    {"task": TASK, "args": [due, f"s{i}"], "eta": eta} for i in range(ns.jobs)
                )
            if written != ns.jobs:
                raise SystemExit(f"scheduled {written} of {ns.jobs} jobs")
            samples = watch_depth(
                depth,
                target=ns.jobs,
                start_timeout=ns.lead + 60,
                window=600,
                alive=lambda: all(proc.alive() for proc in procs),
            )
        finally:
            for cpu in cpus:
                cpu.stop()
            depth.close()
        rate = arrival_rate(samples, ns.jobs)
        cpu_per_job = None
        if len(samples) >= 2:
            t_first, t_last, arrived = arrival_window(samples)
            used = [cpu.used(t_first, t_last) for cpu in cpus]
            if arrived and all(u is not None for u in used):
                cpu_per_job = sum(u for u in used if u is not None) / arrived * 1e6
        shards_used = run.query(
            "SELECT count(DISTINCT shard) FROM {s}.jobs WHERE dispatched_at IS NOT NULL"
        )[0][0]
        progress(
            "%d beat(s), run %d: %s jobs in %ss = %.0f jobs/s, %s us beat CPU per job "
            "(balanced in %.1fs)",
            beats,
            index,
            rate["messages"],
            rate["seconds"],
            rate["per_s"],
            rounded(cpu_per_job, 1),
            balance_s,
        )
        return {
            **rate,
            "beats": beats,
            "balance_s": round(balance_s, 2),
            "beat_cpu_us_per_job": rounded(cpu_per_job, 1),
            "shards_dispatched": int(shards_used),
        }
    finally:
        run.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--beats", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument(
        "--lead", type=float, default=8.0, help="seconds between scheduling and the due time"
    )
    ns = parser.parse_args()
    results: dict[int, list[dict[str, Any]]] = {beats: [] for beats in ns.beats}
    for index in range(1, ns.runs + 1):
        for beats in ns.beats:
            results[beats].append(one_run(ns, beats, index))
    summary = {}
    for beats, runs in results.items():
        summary[str(beats)] = {
            "jobs_per_s": rounded(median([r["per_s"] for r in runs if r.get("complete")])),
            "beat_cpu_us_per_job": rounded(
                median([r["beat_cpu_us_per_job"] for r in runs if r["beat_cpu_us_per_job"]]), 1
            ),
            "runs": runs,
        }
    base = summary[str(ns.beats[0])]["jobs_per_s"]
    emit(
        {
            "benchmark": "scale",
            "jobs": ns.jobs,
            "shards": ns.shards,
            "runs": ns.runs,
            "load_avg": load_avg(),
            "by_beats": summary,
            "rate_vs_first": {
                beats: rounded(s["jobs_per_s"] / base) if s["jobs_per_s"] and base else None
                for beats, s in summary.items()
            },
        }
    )


if __name__ == "__main__":
    main()
