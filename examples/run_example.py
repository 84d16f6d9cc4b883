"""Schedule 100,000 jobs over the next 24 hours and show how they are stored.

Run it with ``./scripts/example.sh``, or ``python examples/run_example.py``
once PostgreSQL is up. It works in its own schema, ``celery_sched_example``,
which it drops at the start so that every run begins from nothing.

Nothing here needs a worker or a beat process: jobs wait in PostgreSQL until
``celery -A proj beat -S celery_sched`` dispatches them when they fall due.
"""

from __future__ import annotations

import datetime as dt
import random
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from proj.celery_app import app
from proj.tasks import send_reminder
from psycopg import sql

from celery_sched import Client
from celery_sched.settings import Settings

SCHEMA = "celery_sched_example"
JOB_COUNT = 100_000
HORIZON = dt.timedelta(hours=24)


def drop_schema() -> None:
    """Drop the example schema so that a rerun starts clean."""
    conninfo = Settings.from_app(app).libpq_conninfo()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))


def reminders(start: dt.datetime) -> Iterator[dict[str, Any]]:
    """One reminder per user, due at a random moment within ``HORIZON``."""
    rng = random.Random(2024)  # a fixed seed keeps the printed counts stable
    for user_id in range(JOB_COUNT):
        yield {
            "task": send_reminder.name,
            "args": (user_id, "your trial ends soon"),
            "eta": start + rng.random() * HORIZON,
            # A key per job: scheduling the same reminder twice is refused.
            "key": f"reminder:{user_id}",
        }


def main() -> None:
    # Settings come from app.conf (or CELERY_SCHED_* environment variables).
    app.conf.celery_sched_db_schema = SCHEMA
    app.conf.celery_sched_key_prefix = SCHEMA
    drop_schema()

    with Client(app) as client:
        client.migrate()

        start = dt.datetime.now(dt.UTC)
        began = time.perf_counter()
        written = client.schedule_many(reminders(start))
        elapsed = time.perf_counter() - began
        print(f"scheduled {written:,} jobs in {elapsed:.2f}s ({written / elapsed:,.0f} jobs/s)")

        # One job at a time; the arguments mirror Celery's send_task.
        job = client.schedule(
            send_reminder.name,
            args=(JOB_COUNT, "one more"),
            countdown=600,
            key="reminder:extra",
            queue="celery",
        )
        print(f"scheduled {job.key} due {job.due_at:%Y-%m-%d %H:%M:%S} UTC, status {job.status}")
        cancelled = client.cancel(job.key)
        stored = client.get(job.key)
        print(f"cancel({job.key!r}) -> {cancelled}; status now {stored.status if stored else None}")

        print("\njobs per status:")
        for status, count in sorted(client.counts_by_status().items()):
            print(f"  {status:<10} {count:>8,}")

        print("\njobs per hour (UTC):")
        for hour, count in sorted(client.counts_by_hour().items()):
            print(f"  {hour:%Y-%m-%d %H:00}  {count:>6,}")


if __name__ == "__main__":
    main()
