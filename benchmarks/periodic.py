"""Periodic schedules at scale, and on-time firing against stock beat and redbeat.

celery_sched, for each size in ``--sizes`` (default 10,000 and ``--entries``,
100,000): that many interval schedules of ``--every`` (60) seconds are added
to a fresh schema with ``Client.schedules.add_many``, their first instants
spread evenly over one interval starting at T0 (set with one SQL UPDATE: the
API would put them all at "now + 60 s"), and one ``celery beat -S
celery_sched`` process starts. Measured:

- ``elected_s``: from spawning beat to its leader epoch in PostgreSQL;
- ``startup_s``: from spawning beat until every schedule has been planned
  (its occurrences are rows);
- ``planner_occurrences_per_s``: occurrence rows written per second during
  that initial planning (each schedule gets the occurrences inside the
  planning horizon, 120 s by default);
- ``rss_mb``: the beat process's peak resident memory while it dispatches
  in steady state; ``rss_ratio`` compares the largest size with the smallest
  (target < 1.5: memory does not grow with the number of schedules stored);
- ``on_time``: of the occurrences due in the measurement window (``--window``
  seconds, after ``--warmup`` seconds), the fraction whose message reached
  the queue within 1 s of its nominal time (a raw consumer pops the Redis
  list and stamps receive times; nobody runs the tasks).

In the same run, stock ``celery beat`` (PersistentScheduler) and
``celery-redbeat`` get ``--legacy-entries`` (10,000) entries of the same
interval in ``beat_schedule``, spread the same way (``last_run_at`` one
interval before each first instant), and the same on-time fraction is
measured against the ideal grid T0 + i * every / entries + k * every.

    .venv/bin/python benchmarks/periodic.py [--entries 100000] [--sizes 10000 100000]
        [--legacy-entries 10000] [--every 60] [--window 120] [--warmup 20] [--no-legacy]

``--entries 2000 --legacy-entries 500 --window 20`` is a quick check. The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import bisect
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import psutil
from _common import RawConsumer, Received, Run, emit, load_avg, progress, rounded
from periodic_app import TASK, app

from celery_sched.client import Client
from tests.e2e.harness import Proc, percentile, wait_for

TARGET_RSS_RATIO = 1.5
ON_TIME_TOLERANCE = 1.0
#: A message this much before its nominal time still counts as that occurrence
#: (the schedulers' clocks and the consumer's are the same host's).
EARLY_TOLERANCE = 0.5

LEGACY_SCHEDULERS = {
    "beat": "celery.beat:PersistentScheduler",
    "redbeat": "redbeat.RedBeatScheduler",
}


class RssSampler:
    """Peak resident memory of one process, sampled on demand."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0

    def sample(self) -> int:
        try:
            rss = int(self.process.memory_info().rss)
        except psutil.Error:
            return self.peak
        self.peak = max(self.peak, rss)
        return rss


def on_time(
    messages: Iterable[Received],
    *,
    entries: int,
    every: float,
    t0: float,
    start: float,
    end: float,
) -> dict[str, Any]:
    """How many occurrences with a nominal time in [start, end) arrived on time.

    Entry ``i``'s nominal instants are ``t0 + i * every / entries + k * every``;
    an occurrence is on time when a message for entry ``i`` arrived within
    [nominal - 0.5 s, nominal + 1 s].
    """
    arrivals: dict[int, list[float]] = defaultdict(list)
    total = 0
    for message in messages:
        arrivals[int(message.args[0])].append(message.received)
        total += 1
    due = met = 0
    lags: list[float] = []
    for index in range(entries):
        times = sorted(arrivals.get(index, ()))
        phase = t0 + index * every / entries
        k = max(0, math.ceil((start - phase) / every))
        nominal = phase + k * every
        while nominal < end:
            due += 1
            at = bisect.bisect_left(times, nominal - EARLY_TOLERANCE)
            if at < len(times):
                lag = times[at] - nominal
                if lag <= ON_TIME_TOLERANCE:
                    met += 1
                if lag < every - EARLY_TOLERANCE:
                    lags.append(lag)
            nominal += every
    return {
        "due": due,
        "on_time": met,
        "fraction": round(met / due, 4) if due else None,
        "messages": total,
        "lag_p50_s": rounded(percentile(lags, 50)),
        "lag_p99_s": rounded(percentile(lags, 99)),
    }


def wait_until(
    deadline: float, sampler: RssSampler | None = None, beat: Proc | None = None
) -> None:
    while time.time() < deadline:
        if beat is not None and not beat.alive():
            raise SystemExit(f"{beat.name} exited early:\n{beat.tail()}")
        if sampler is not None:
            sampler.sample()
        time.sleep(min(1.0, max(0.0, deadline - time.time())))


def run_ours(entries: int, args: argparse.Namespace) -> dict[str, Any]:
    run = Run("periodic", broker="redis")
    consumer = RawConsumer(run.queue)
    try:
        with Client(app, settings=run.settings, staging=False) as client:
            client.migrate()
            began = time.perf_counter()
            added = client.schedules.add_many(
                {"name": f"p{i:06d}", "task": TASK, "schedule": args.every, "args": (i,)}
                for i in range(entries)
            )
            add_s = time.perf_counter() - began
        progress("%d schedules added in %.1fs (%s)", added, add_s, run.name)
        # Leave time to start and plan before the first instant.
        t0 = time.time() + 15 + entries / 4000
        run.execute(
            "UPDATE {s}.schedules s SET next_nominal_at = "
            "to_timestamp(%s) + r.i * %s * interval '1 second' "
            "FROM (SELECT id, row_number() OVER (ORDER BY name) - 1 AS i "
            "FROM {s}.schedules) r WHERE s.id = r.id",
            t0,
            args.every / entries,
        )
        consumer.start()
        spawned = time.monotonic()
        beat = run.start_beat(
            "celery_sched", app="periodic_app", scheduler="celery_sched", BENCH_PERIODIC_ENTRIES="0"
        )
        sampler = RssSampler(beat.pid)
        wait_for(run.leader, timeout=120, interval=0.1, what="a leader")
        elected_s = time.monotonic() - spawned

        first_row: float | None = None
        rows = 0
        while True:
            sampler.sample()
            planned, rows = run.query(
                "SELECT (SELECT count(*) FROM {s}.schedules WHERE last_nominal_at IS NOT NULL), "
                "(SELECT count(*) FROM {s}.jobs)"
            )[0]
            now = time.monotonic()
            if rows and first_row is None:
                first_row = now
            if planned >= entries:
                break
            if now - spawned > 600 or not beat.alive():
                raise SystemExit(f"planning did not finish:\n{beat.tail()}")
            time.sleep(0.25)
        startup_s = time.monotonic() - spawned
        planning_s = max(time.monotonic() - (first_row or spawned), 1e-3)
        progress(
            "%d schedules: leader after %.1fs, all planned after %.1fs (%d rows)",
            entries,
            elected_s,
            startup_s,
            rows,
        )
        start = t0 + args.warmup
        end = start + args.window
        wait_until(end + 3, sampler, beat)
        result = on_time(
            consumer.messages(), entries=entries, every=args.every, t0=t0, start=start, end=end
        )
        progress(
            "%d schedules: on time %s, peak RSS %.0f MB", entries, result, sampler.peak / 2**20
        )
        return {
            "entries": entries,
            "add_s": round(add_s, 2),
            "elected_s": round(elected_s, 2),
            "startup_s": round(startup_s, 2),
            "initial_occurrences": int(rows),
            "planner_occurrences_per_s": round(int(rows) / planning_s, 1),
            "rss_mb": round(sampler.peak / 2**20, 1),
            "on_time": result,
        }
    finally:
        consumer.stop()
        run.cleanup()


def run_legacy(kind: str, entries: int, args: argparse.Namespace) -> dict[str, Any]:
    run = Run(f"periodic_{kind}", broker="redis")
    consumer = RawConsumer(run.queue)
    try:
        t0 = time.time() + 20 + entries / 1000
        consumer.start()
        beat = run.start_beat(
            kind,
            app="periodic_app",
            scheduler=LEGACY_SCHEDULERS[kind],
            BENCH_PERIODIC_ENTRIES=str(entries),
            BENCH_PERIODIC_EVERY=str(args.every),
            BENCH_PERIODIC_T0=repr(t0),
        )
        sampler = RssSampler(beat.pid)
        start = t0 + args.warmup
        end = start + args.window
        wait_until(end + 3, sampler, beat)
        result = on_time(
            consumer.messages(), entries=entries, every=args.every, t0=t0, start=start, end=end
        )
        progress("%s, %d entries: on time %s", kind, entries, result)
        return {"entries": entries, "rss_mb": round(sampler.peak / 2**20, 1), "on_time": result}
    finally:
        consumer.stop()
        run.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--sizes", type=int, nargs="+", default=None)
    parser.add_argument("--legacy-entries", type=int, default=10_000)
    parser.add_argument("--every", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=120.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--no-legacy", action="store_true")
    args = parser.parse_args()
    sizes = args.sizes or sorted({min(10_000, args.entries), args.entries})

    ours = {size: run_ours(size, args) for size in sizes}
    legacy: dict[str, Any] = {}
    if not args.no_legacy:
        for kind in LEGACY_SCHEDULERS:
            legacy[kind] = run_legacy(kind, args.legacy_entries, args)

    smallest, largest = ours[min(sizes)], ours[max(sizes)]
    ratio = largest["rss_mb"] / smallest["rss_mb"] if smallest["rss_mb"] else None
    same = ours.get(args.legacy_entries)
    emit(
        {
            "benchmark": "periodic",
            "every_s": args.every,
            "window_s": args.window,
            "celery_sched": {str(size): result for size, result in ours.items()},
            "startup_s": largest["startup_s"],
            "planner_occurrences_per_s": largest["planner_occurrences_per_s"],
            "rss_ratio": None if ratio is None else round(ratio, 3),
            "rss_ratio_target": TARGET_RSS_RATIO,
            "rss_ratio_met": None if ratio is None else ratio < TARGET_RSS_RATIO,
            "legacy": legacy,
            "on_time_fraction": {
                **({"celery_sched": same["on_time"]["fraction"]} if same else {}),
                **{kind: result["on_time"]["fraction"] for kind, result in legacy.items()},
            },
            "load_avg": load_avg(),
        }
    )


if __name__ == "__main__":
    main()
