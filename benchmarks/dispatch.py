"""Dispatch throughput of one ``celery beat -S celery_sched`` against stock beat and redbeat.

For each of ``--runs`` runs (fresh schema each): ``--jobs`` jobs due now
(default 200,000) are scheduled with ``Client.schedule_many`` before the beat
starts; then one beat process publishes them to a queue nobody consumes. The
rate is measured on the broker side: the queue depth (Redis ``LLEN``, or a
passive ``queue_declare`` on RabbitMQ) is sampled every 20 ms, and

    jobs/s = jobs / (time the last one arrived - time the first one arrived)

``jobs.dispatched_at`` (claim time, Postgres clock) gives a second figure.

On Redis, each run then takes the reference of issue #31: the envelopes the
beat wrote are read back from the queue (``LRANGE``), the queue is emptied,
and the very same envelopes are written again by a raw redis-py pipeline, one
``LPUSH`` per envelope, executed every ``--batch-size`` envelopes (no claim,
no encoding: the floor of a Python client writing these bytes). Its rate is
envelopes / (last pipeline's reply - start), and each run's ratio is ours
over it, both taken in that run; the beat's CPU per job stands beside it.

In the same invocation, stock ``celery beat`` (PersistentScheduler, schedule
file in a temp dir) and ``celery-redbeat`` get ``beat_schedule``s of the same
sizes (``--legacy-sizes``, default: --jobs and 5,000), every entry due at
start; their messages are counted for up to ``--window`` seconds after the
first one arrives, and their sustained rate is reported: the median of
``--legacy-runs`` runs (default: as many as ``--runs``; a size where the first
run publishes nothing is not repeated). Ratios compare our median with each
median at the same size.

    .venv/bin/python benchmarks/dispatch.py [--jobs 200000] [--runs 3] [--broker redis|amqp]
        [--legacy-sizes 200000 5000] [--legacy-runs 3] [--window 30] [--no-legacy] [--analyze]
        [--metrics off|on|ab]

Targets (Redis): >= 10,000 jobs/s, >= 25x celery-redbeat's rate, >= 0.5x the
raw pipelined LPUSH of the same envelopes, and beat CPU <= 12 us per job.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
import urllib.request
from typing import Any

import redis
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
from tests.e2e.harness import free_port

TARGET_RATE = 10_000.0
TARGET_RATIO_REDBEAT = 25.0
#: Issue #31, target 2: our rate against a raw pipelined LPUSH of the same
#: envelopes, and the beat's CPU per job.
TARGET_RATIO_RAW_LPUSH = 0.5
TARGET_BEAT_CPU_US = 12.0

LEGACY_SCHEDULERS = {
    "beat": "celery.beat:PersistentScheduler",
    "redbeat": "redbeat.RedBeatScheduler",
}


def schedule_due_now(run: Run, jobs: int, *, analyze: bool = False) -> float:
    """Insert ``jobs`` jobs due now; return the seconds it took.

    With ``analyze``, ANALYZE the table afterwards (what autovacuum does
    eventually), so the claim plans see the real row counts.
    """
    started = time.perf_counter()
    with Client(app, settings=run.settings) as client:
        client.migrate()
        due = time.time()
        written = client.schedule_many({"task": TASK, "args": [due, f"d{i}"]} for i in range(jobs))
    if written != jobs:
        raise SystemExit(f"scheduled {written} of {jobs} jobs")
    if analyze:
        run.execute("ANALYZE {s}.jobs")
    return time.perf_counter() - started


def raw_lpush(redis_url: str, queue: str, batch_size: int) -> dict[str, Any]:
    """Write the envelopes now in ``queue`` again with a raw pipelined ``LPUSH``.

    Reads them (oldest first), empties the queue, then LPUSHes each envelope
    on its own through a redis-py pipeline executed every ``batch_size``
    envelopes, and returns the rate and the client's CPU per envelope.
    """
    client = redis.Redis.from_url(redis_url)
    try:
        envelopes: list[bytes] = []
        page = 10_000
        length = client.llen(queue)
        for start in range(0, length, page):
            envelopes.extend(client.lrange(queue, -start - page, -start - 1)[::-1])
        client.delete(queue)
        started = time.perf_counter()
        cpu_started = time.process_time()
        pipe = client.pipeline(transaction=False)
        for at in range(0, len(envelopes), batch_size):
            for envelope in envelopes[at : at + batch_size]:
                pipe.lpush(queue, envelope)
            pipe.execute()
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
        written = client.llen(queue)
        client.delete(queue)
    finally:
        client.close()
    if written != len(envelopes):
        raise SystemExit(f"raw LPUSH wrote {written} of {len(envelopes)} envelopes")
    return {
        "envelopes": len(envelopes),
        "per_s": round(len(envelopes) / seconds, 1) if envelopes else None,
        "client_cpu_us_per_job": round(cpu / len(envelopes) * 1e6, 2) if envelopes else None,
    }


class Scraper:
    """Fetches a beat's /metrics every ``interval`` seconds, as Prometheus would."""

    def __init__(self, port: int, interval: float = 1.0) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.interval = interval
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url, timeout=5) as answer:
                    answer.read()
                self.scrapes += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.scrapes


def run_ours(
    broker: str, jobs: int, batch_size: int, index: int, analyze: bool, metrics: bool = False
) -> dict[str, Any]:
    run = Run("dispatch", broker=broker, batch_size=batch_size)
    try:
        insert_s = schedule_due_now(run, jobs, analyze=analyze)
        progress("run %d: %d jobs due now inserted in %.1fs (%s)", index, jobs, insert_s, run.name)
        depth = QueueDepth(run.broker, run.queue)
        try:
            started = time.monotonic()
            env = {}
            if metrics:
                port = free_port()
                env["CELERY_SCHED_METRICS_PORT"] = str(port)
            beat = run.start_beat("beat", **env)
            cpu = CpuSampler(beat.pid)
            scraper = Scraper(port) if metrics else None
            try:
                samples = watch_depth(
                    depth, target=jobs, start_timeout=90, window=600, alive=beat.alive
                )
            finally:
                cpu.stop()
                scrapes = None if scraper is None else scraper.stop()
        finally:
            depth.close()
        rate = arrival_rate(samples, jobs)
        cpu_per_job = None
        if len(samples) >= 2:
            t_first, t_last, arrived = arrival_window(samples)
            used = cpu.used(t_first, t_last)
            if used is not None and arrived:
                cpu_per_job = used / arrived * 1e6
        startup = samples[0][0] - started if samples else None
        first, last, dispatched = run.dispatched_span()
        beat.stop()
        raw = None
        if run.broker.startswith(("redis://", "rediss://")) and rate.get("complete"):
            raw = raw_lpush(run.broker, run.queue, batch_size)
            progress(
                "run %d: raw pipelined LPUSH of the same %d envelopes: %.0f/s (ratio %.2f)",
                index,
                raw["envelopes"],
                raw["per_s"],
                rate["per_s"] / raw["per_s"],
            )
        pg_rate = None
        if first is not None and last is not None and last > first:
            pg_rate = dispatched / (last - first).total_seconds()
        if not rate.get("complete"):
            progress(
                "run %d: only %s of %d arrived; beat log:\n%s",
                index,
                rate["messages"],
                jobs,
                beat.tail(),
            )
        progress(
            "run %d: %s jobs in %ss on the broker = %.0f jobs/s (dispatched_at span: %s/s)",
            index,
            rate["messages"],
            rate["seconds"],
            rate["per_s"],
            None if pg_rate is None else round(pg_rate),
        )
        return {
            **rate,
            "metrics": metrics,
            "scrapes": scrapes,
            "insert_s": round(insert_s, 2),
            "beat_start_to_first_publish_s": rounded(startup, 2),
            # The beat process's CPU (all threads) per job while publishing.
            "beat_cpu_us_per_job": rounded(cpu_per_job, 1),
            "pg_dispatched": dispatched,
            "pg_dispatched_span_per_s": None if pg_rate is None else round(pg_rate, 1),
            "raw_lpush": raw,
            "ratio_vs_raw_lpush": (
                round(rate["per_s"] / raw["per_s"], 3) if raw and raw["per_s"] else None
            ),
        }
    finally:
        run.cleanup()


def run_legacy(kind: str, broker: str, entries: int, window: float) -> dict[str, Any]:
    run = Run(f"dispatch_{kind}", broker=broker)
    try:
        depth = QueueDepth(run.broker, run.queue)
        try:
            started = time.monotonic()
            beat = run.start_beat(
                kind,
                scheduler=LEGACY_SCHEDULERS[kind],
                loglevel="WARNING",
                BENCH_BEAT_ENTRIES=str(entries),
            )
            samples = watch_depth(
                depth, target=entries, start_timeout=300, window=window, alive=beat.alive
            )
        finally:
            depth.close()
        beat.stop()
        rate = arrival_rate(samples, entries)
        if not samples:
            progress("%s (%d entries): nothing arrived; log:\n%s", kind, entries, beat.tail())
        rate["start_to_first_publish_s"] = rounded(samples[0][0] - started if samples else None, 2)
        progress(
            "%s (%d entries): %s messages in %ss = %.1f/s (first after %ss)",
            kind,
            entries,
            rate["messages"],
            rate["seconds"],
            rate["per_s"],
            rate["start_to_first_publish_s"],
        )
        return rate
    finally:
        run.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--broker", default="redis", help="redis, amqp, or a broker URL")
    parser.add_argument("--batch-size", type=int, default=1000, help="celery_sched_batch_size")
    parser.add_argument("--legacy-sizes", type=int, nargs="*", default=None)
    parser.add_argument("--window", type=float, default=30.0, help="legacy counting window, s")
    parser.add_argument("--legacy-runs", type=int, default=None, help="default: --runs")
    parser.add_argument("--no-legacy", action="store_true")
    parser.add_argument(
        "--analyze", action="store_true", help="ANALYZE the jobs table after the insert"
    )
    parser.add_argument(
        "--metrics",
        choices=("off", "on", "ab"),
        default="off",
        help="on: the beat serves /metrics (celery_sched_metrics_port) and is scraped every "
        "second while it dispatches; ab: --runs pairs, off and on alternating, with the "
        "medians of each and their ratios",
    )
    ns = parser.parse_args()

    load_start = load_avg()
    if ns.metrics == "ab":
        emit(metrics_ab(ns))
        return
    ours = [
        run_ours(ns.broker, ns.jobs, ns.batch_size, i + 1, ns.analyze, ns.metrics == "on")
        for i in range(ns.runs)
    ]
    rates = [r["per_s"] for r in ours if r.get("complete")]
    our_rate = median(rates) if len(rates) == len(ours) else None
    beat_cpu = [r["beat_cpu_us_per_job"] for r in ours if r["beat_cpu_us_per_job"] is not None]
    raw_ratios = [r["ratio_vs_raw_lpush"] for r in ours if r["ratio_vs_raw_lpush"] is not None]
    raw_rates = [r["raw_lpush"]["per_s"] for r in ours if r["raw_lpush"]]

    legacy: dict[str, dict[str, Any]] = {}
    sizes = [] if ns.no_legacy else (ns.legacy_sizes or [ns.jobs, 5_000])
    legacy_runs = max(1, ns.legacy_runs or ns.runs)
    for kind in LEGACY_SCHEDULERS:
        for entries in sizes:
            results = [run_legacy(kind, ns.broker, entries, ns.window)]
            while results[0]["messages"] and len(results) < legacy_runs:
                results.append(run_legacy(kind, ns.broker, entries, ns.window))
            summary = dict(sorted(results, key=lambda r: r["per_s"])[len(results) // 2])
            summary["runs_per_s"] = [r["per_s"] for r in results]
            legacy.setdefault(kind, {})[str(entries)] = summary

    ratios: dict[str, dict[str, float | None]] = {}
    for kind, by_size in legacy.items():
        for size, result in by_size.items():
            per_s = result["per_s"]
            ratios.setdefault(kind, {})[size] = (
                round(our_rate / per_s, 1) if our_rate and per_s else None
            )
    # Judged on every size where redbeat published anything (at 200,000
    # entries it may publish nothing within the start timeout), worst first.
    redbeat_ratios = [r for r in ratios.get("redbeat", {}).values() if r is not None]
    on_redis = ns.broker == "redis" or ns.broker.startswith("redis")
    met = {
        "jobs_per_s": None if not on_redis else bool(our_rate and our_rate >= TARGET_RATE),
        "ratio_vs_redbeat": (
            None
            if not redbeat_ratios or not on_redis
            else min(redbeat_ratios) >= TARGET_RATIO_REDBEAT
        ),
        "ratio_vs_raw_lpush": (
            None if not raw_ratios else statistics.median(raw_ratios) >= TARGET_RATIO_RAW_LPUSH
        ),
        "beat_cpu_us_per_job": (
            None if not beat_cpu else statistics.median(beat_cpu) <= TARGET_BEAT_CPU_US
        ),
    }
    emit(
        {
            "benchmark": "dispatch",
            "broker": ns.broker.split("://")[0],
            "jobs": ns.jobs,
            "batch_size": ns.batch_size,
            "analyzed_after_insert": ns.analyze,
            "measured_by": "queue depth sampled every 20 ms (first to last arrival)",
            "runs": [r["per_s"] for r in ours],
            "jobs_per_s": rounded(our_rate, 1),
            "beat_cpu_us_per_job": rounded(median(beat_cpu), 1) if beat_cpu else None,
            "pg_dispatched_span_per_s": rounded(
                median([r["pg_dispatched_span_per_s"] or 0.0 for r in ours]), 1
            ),
            # Each run's rate over its own raw LPUSH reference; the median of those.
            "raw_lpush_per_s": rounded(median(raw_rates), 1) if raw_rates else None,
            "ratio_vs_raw_lpush": rounded(median(raw_ratios), 3) if raw_ratios else None,
            "runs_ratio_vs_raw_lpush": raw_ratios,
            "run_details": ours,
            "legacy_window_s": ns.window,
            "legacy": legacy,
            "ratio": ratios,
            "targets": {
                "jobs_per_s": TARGET_RATE,
                "ratio_vs_redbeat": TARGET_RATIO_REDBEAT,
                "ratio_vs_raw_lpush": TARGET_RATIO_RAW_LPUSH,
                "beat_cpu_us_per_job": TARGET_BEAT_CPU_US,
            },
            "met": met,
            "load_avg_1m_start": load_start,
            "load_avg_1m_end": load_avg(),
        }
    )


def metrics_ab(ns: argparse.Namespace) -> dict[str, Any]:
    """Beat without and with metrics served and scraped, alternating in one invocation."""
    load_start = load_avg()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for i in range(ns.runs):
        for side in ("off", "on"):
            runs[side].append(
                run_ours(ns.broker, ns.jobs, ns.batch_size, i + 1, ns.analyze, side == "on")
            )

    def medians(side: str) -> tuple[float | None, float | None]:
        rates = [r["per_s"] for r in runs[side] if r.get("complete")]
        cpu = [r["beat_cpu_us_per_job"] for r in runs[side] if r["beat_cpu_us_per_job"]]
        return (median(rates) if rates else None, median(cpu) if cpu else None)

    rate_off, cpu_off = medians("off")
    rate_on, cpu_on = medians("on")
    return {
        "benchmark": "dispatch_metrics_ab",
        "broker": ns.broker.split("://")[0],
        "jobs": ns.jobs,
        "pairs": ns.runs,
        "scrape_interval_s": 1.0,
        "jobs_per_s": {"off": rounded(rate_off, 1), "on": rounded(rate_on, 1)},
        "beat_cpu_us_per_job": {"off": rounded(cpu_off, 1), "on": rounded(cpu_on, 1)},
        "rate_ratio_on_vs_off": (rounded(rate_on / rate_off, 3) if rate_on and rate_off else None),
        "cpu_ratio_on_vs_off": rounded(cpu_on / cpu_off, 3) if cpu_on and cpu_off else None,
        "runs": {
            side: [(r["per_s"], r["beat_cpu_us_per_job"]) for r in rs] for side, rs in runs.items()
        },
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": load_avg(),
    }


if __name__ == "__main__":
    main()
