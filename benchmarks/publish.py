"""Publish throughput: KombuDispatcher vs ``app.send_task`` one by one.

Publishes N pre-built jobs (default 200,000) to a throwaway queue on the
broker, three times, and reports the median jobs/s; in the same run sends a
sample with ``app.send_task`` for the ratio. The queue is deleted afterwards.
The last printed line is one JSON object.

    .venv/bin/python benchmarks/publish.py [-n 200000] [--broker redis://127.0.0.1:6379/0]
    .venv/bin/python benchmarks/publish.py --broker amqp://guest:guest@127.0.0.1:5672//
    .venv/bin/python benchmarks/publish.py --sent-events  # events off vs on, same run
    .venv/bin/python benchmarks/publish.py --sent-events --broker amqp://guest:guest@127.0.0.1:5672//
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
import uuid

from celery import Celery
from kombu.serialization import dumps
from kombu.utils.encoding import safe_repr

from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.models import Job, JobStatus
from celery_sched.settings import Settings
from celery_sched.timeutil import to_bucket

EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def make_jobs(n: int, task: str, queue: str, now: dt.datetime) -> list[Job]:
    jobs = []
    for i in range(n):
        args, kwargs = (i, "x" * 16), {"n": i}
        content_type, encoding, body = dumps([args, kwargs, EMBED], serializer="json")
        jobs.append(
            Job(
                id=uuid.uuid4(),
                key=f"bench-{i}",
                task=task,
                body=body if isinstance(body, bytes) else body.encode(),
                content_type=content_type,
                content_encoding=encoding,
                argsrepr=safe_repr(args),
                kwargsrepr=safe_repr(kwargs),
                due_at=now,
                due_bucket=to_bucket(now),
                status=JobStatus.DISPATCHED,
                options={"queue": queue},
                expires_at=now + dt.timedelta(hours=1) if i % 2 else None,
            )
        )
    return jobs


def purge(app: Celery, queue: str, *, delete: bool = False) -> None:
    # Between runs the queue is only purged: the dispatcher declared it once
    # per connection, and RabbitMQ drops messages for a deleted queue.
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        channel.queue_purge(queue)
        if delete:
            channel.queue_delete(queue)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=200_000, help="jobs per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sample", type=int, default=5_000, help="send_task sample size")
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--batch", type=int, default=5_000, help="jobs per publish() call")
    parser.add_argument(
        "--sent-events",
        action="store_true",
        help="also time runs with task_send_sent_event on and report the ratio to off",
    )
    ns = parser.parse_args()

    app = Celery("bench_publish", broker=ns.broker)
    app.conf.task_send_sent_event = False
    task = "bench.noop"
    queue = "celery_sched_bench_" + uuid.uuid4().hex[:8]
    now = dt.datetime.now(dt.UTC)
    settings = Settings(hostname="celery_sched@bench")
    jobs = make_jobs(ns.n, task, queue, now)

    rates: list[float] = []
    cpu_us: list[float] = []
    event_rates: list[float] = []
    event_paths: list[str] = []
    events_written_by: list[str] = []
    dispatcher = KombuDispatcher(app, settings)
    try:
        if ns.sent_events:
            # Off and on alternate, so a busy neighbour weighs on both alike.
            events_app = Celery("bench_publish_events", broker=ns.broker)
            events_app.conf.task_send_sent_event = True
            for _ in range(ns.runs):
                event_dispatcher = KombuDispatcher(events_app, settings)
                try:
                    start = time.perf_counter()
                    for i in range(0, len(jobs), ns.batch):
                        result = event_dispatcher.publish(jobs[i : i + ns.batch], epoch=1, now=now)
                        if result.failed:
                            raise SystemExit(f"{len(result.failed)} jobs failed to publish")
                    event_rates.append(ns.n / (time.perf_counter() - start))
                    event_paths.append(str(event_dispatcher.publish_path))
                    events_written_by.append(str(event_dispatcher.sent_events_path))
                finally:
                    event_dispatcher.close()
                purge(app, queue)
        for _ in range(ns.runs):
            start = time.perf_counter()
            cpu_start = time.process_time()
            sent = 0
            for i in range(0, len(jobs), ns.batch):
                result = dispatcher.publish(jobs[i : i + ns.batch], epoch=1, now=now)
                if result.failed:
                    raise SystemExit(f"{len(result.failed)} jobs failed to publish")
                sent += len(result.sent)
            elapsed = time.perf_counter() - start
            cpu_us.append((time.process_time() - cpu_start) / ns.n * 1e6)
            assert sent == ns.n, sent
            rates.append(sent / elapsed)
            purge(app, queue)
        dispatcher.close()

        sample = jobs[: ns.sample]
        start = time.perf_counter()
        with app.producer_or_acquire() as producer:
            for job in sample:
                args, kwargs = job.decode()
                app.send_task(
                    task, args, kwargs, task_id=str(job.id), queue=queue, producer=producer
                )
        send_task_rate = len(sample) / (time.perf_counter() - start)
    finally:
        dispatcher.close()
        purge(app, queue, delete=True)

    median = statistics.median(rates)
    extra = {}
    if ns.sent_events:
        events_median = statistics.median(event_rates)
        extra = {
            "sent_events_runs": [round(r) for r in event_rates],
            "sent_events_paths": event_paths,
            # The path of the events themselves (Kombu's after a sample mismatch).
            "sent_events_written_by": events_written_by,
            "sent_events_jobs_per_s": round(events_median),
            "sent_events_ratio": round(events_median / median, 2),
        }
    print(
        json.dumps(
            {
                "benchmark": "publish",
                "broker": ns.broker.split("://")[0],
                "jobs": ns.n,
                "batch": ns.batch,
                "runs": [round(r) for r in rates],
                "jobs_per_s": round(median),
                "client_cpu_us_per_job": round(statistics.median(cpu_us), 1),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "send_task_jobs_per_s": round(send_task_rate),
                "speedup_vs_send_task": round(median / send_task_rate, 1),
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
