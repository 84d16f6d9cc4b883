"""RabbitMQ dispatch with publisher confirms against raw py-amqp with confirms.

Publishes N pre-built jobs (default 50,000) to a throwaway durable queue
through ``KombuDispatcher`` (confirms on, the default; a chunk's jobs count
as sent once RabbitMQ confirmed it), and, in the same run, the very same
messages (bodies, headers, properties as the dispatcher prepared them) by
raw py-amqp: ``confirm_select``, then per chunk ``basic_publish`` of each
``amqp.Message`` followed by a wait for every ack of the chunk. Runs
alternate (dispatcher, raw, dispatcher without confirms), so a busy
neighbour weighs on each alike, after an untimed warm-up of both; the
queue is purged between runs and deleted at the end. Reports the medians,
client CPU per job, and the ratio of the dispatcher to raw py-amqp taken
within each round (target: 20k jobs/s and 0.5x).

    .venv/bin/python benchmarks/amqp_confirms.py [-n 50000] [--runs 3] [--chunk 500]

The last printed line is one JSON object.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import amqp
from celery import Celery

sys.path.insert(0, str(Path(__file__).resolve().parent))

from publish import make_jobs, purge

from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.dispatch.outgoing import OutgoingMessage
from celery_sched.protocol import base_headers
from celery_sched.settings import Settings

TARGET_RATE = 20_000
TARGET_RATIO = 0.5


def run_dispatcher(
    app: Celery, settings: Settings, jobs: list[Any], batch: int, chunk: int
) -> tuple[float, float, str]:
    now = dt.datetime.now(dt.UTC)
    dispatcher = KombuDispatcher(app, settings, chunk=chunk)
    try:
        # Connect (and choose the path) before timing, as a running beat has.
        dispatcher.publish([], epoch=1, now=now)
        dispatcher._connect()
        start = time.perf_counter()
        cpu = time.process_time()
        sent = 0
        for i in range(0, len(jobs), batch):
            result = dispatcher.publish(jobs[i : i + batch], epoch=1, now=now)
            if result.failed or result.rejected:
                raise SystemExit(f"{len(result.failed)} failed, {len(result.rejected)} rejected")
            sent += len(result.sent)
        elapsed = time.perf_counter() - start
        cpu_us = (time.process_time() - cpu) / len(jobs) * 1e6
        assert sent == len(jobs), sent
        return sent / elapsed, cpu_us, str(dispatcher.publish_path)
    finally:
        dispatcher.close()


def run_raw(
    url: str, messages: list[OutgoingMessage], chunk: int, reply_to: str
) -> tuple[float, float]:
    """Raw py-amqp with publisher confirms, awaited per chunk."""
    conn = amqp.Connection(
        host="127.0.0.1:5672", userid="guest", password="guest", virtual_host="/"
    )
    conn.connect()
    try:
        channel = conn.channel()
        channel.confirm_select()
        floor = 0
        above: set[int] = set()

        def on_ack(tag: int, multiple: bool) -> None:
            nonlocal floor
            if multiple:
                floor = max(floor, tag)
            else:
                above.add(tag)
            while floor + 1 in above:
                floor += 1
                above.discard(floor)

        def on_nack(tag: int, multiple: bool) -> None:
            raise SystemExit(f"raw publish nacked: {tag}")

        channel.events["basic_ack"].add(on_ack)
        channel.events["basic_nack"].add(on_nack)
        publish = channel.basic_publish
        Message = amqp.Message
        published = 0
        start = time.perf_counter()
        cpu = time.process_time()
        for first in range(0, len(messages), chunk):
            for m in messages[first : first + chunk]:
                route = m.route
                expiration = m.expiration
                publish(
                    Message(
                        m.body,
                        content_type=m.content_type,
                        content_encoding=m.content_encoding,
                        application_headers=m.headers,
                        delivery_mode=2,
                        priority=m.priority,
                        correlation_id=m.task_id,
                        reply_to=reply_to,
                        expiration=None if expiration is None else str(int(expiration * 1000)),
                    ),
                    exchange=route.exchange,
                    routing_key=route.routing_key,
                )
                published += 1
            while floor < published:
                conn.drain_events(timeout=10)
        elapsed = time.perf_counter() - start
        cpu_us = (time.process_time() - cpu) / len(messages) * 1e6
        return len(messages) / elapsed, cpu_us
    finally:
        conn.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=50_000, help="jobs per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=500, help="messages per confirmed chunk")
    parser.add_argument("--batch", type=int, default=5_000, help="jobs per publish() call")
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--no-unconfirmed", action="store_true", help="skip the confirms-off runs")
    ns = parser.parse_args()

    app = Celery("bench_amqp_confirms", broker=ns.broker)
    app.conf.task_send_sent_event = False
    queue = "celery_sched_bench_" + uuid.uuid4().hex[:8]
    now = dt.datetime.now(dt.UTC)
    settings = Settings(hostname="celery_sched@bench")
    unconfirmed_settings = Settings(hostname="celery_sched@bench", publish_confirms=False)
    jobs = make_jobs(ns.n, "bench.noop", queue, now)
    # The very messages the dispatcher sends, for the raw reference.
    preparer = KombuDispatcher(app, settings)
    messages = preparer._prepare(jobs, epoch=1, now=now, rejected={}, expired=[])
    assert len(messages) == ns.n
    assert messages[0].headers.keys() >= base_headers(origin="x", epoch=1).keys()

    ours: list[float] = []
    ours_cpu: list[float] = []
    raw: list[float] = []
    raw_cpu: list[float] = []
    off: list[float] = []
    off_cpu: list[float] = []
    ratios: list[float] = []
    paths: set[str] = set()
    try:
        # Untimed warm-up of both sides (a new queue's first messages cost
        # RabbitMQ more).
        warm = min(ns.n, 5_000)
        run_dispatcher(app, settings, jobs[:warm], ns.batch, ns.chunk)
        run_raw(ns.broker, messages[:warm], ns.chunk, app.thread_oid)
        purge(app, queue)
        for _ in range(ns.runs):
            rate, cpu, path = run_dispatcher(app, settings, jobs, ns.batch, ns.chunk)
            paths.add(path)
            ours.append(rate)
            ours_cpu.append(cpu)
            purge(app, queue)
            rate, cpu = run_raw(ns.broker, messages, ns.chunk, app.thread_oid)
            raw.append(rate)
            raw_cpu.append(cpu)
            ratios.append(ours[-1] / rate)
            purge(app, queue)
            if not ns.no_unconfirmed:
                rate, cpu, _ = run_dispatcher(app, unconfirmed_settings, jobs, ns.batch, ns.chunk)
                off.append(rate)
                off_cpu.append(cpu)
                purge(app, queue)
    finally:
        purge(app, queue, delete=True)

    median = statistics.median(ours)
    ratio = statistics.median(ratios)
    out: dict[str, Any] = {
        "benchmark": "amqp_confirms",
        "jobs": ns.n,
        "chunk": ns.chunk,
        "path": sorted(paths),
        "runs": [round(r) for r in ours],
        "jobs_per_s": round(median),
        "cpu_us_per_job": round(statistics.median(ours_cpu), 1),
        "raw_confirms_runs": [round(r) for r in raw],
        "raw_confirms_jobs_per_s": round(statistics.median(raw)),
        "raw_cpu_us_per_job": round(statistics.median(raw_cpu), 1),
        "ratio_runs": [round(r, 2) for r in ratios],
        "ratio_to_raw": round(ratio, 2),
        "target_jobs_per_s": TARGET_RATE,
        "target_ratio": TARGET_RATIO,
        "met": median >= TARGET_RATE and ratio >= TARGET_RATIO,
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    if off:
        out["unconfirmed_jobs_per_s"] = round(statistics.median(off))
        out["unconfirmed_cpu_us_per_job"] = round(statistics.median(off_cpu), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
