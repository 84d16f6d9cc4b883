"""The Celery app every dispatch benchmark runs its beat process under.

Configured only from the environment, so one module serves ``celery beat -S
celery_sched``, stock ``celery beat`` (PersistentScheduler) and
``celery-redbeat`` alike, with the same broker, queue and task:

- ``BENCH_BROKER_URL``: the broker (Redis or RabbitMQ).
- ``BENCH_QUEUE``: the default queue, unique per benchmark run.
- ``BENCH_BEAT_ENTRIES``: how many ``beat_schedule`` entries to define (for
  the stock schedulers; 0 for celery_sched, whose jobs live in Postgres).
- ``BENCH_REDIS_URL`` / ``BENCH_REDBEAT_PREFIX``: redbeat's store and key prefix.

Every ``beat_schedule`` entry is an hourly interval whose last run was two
hours ago, so all of them are due the moment the scheduler starts (without
``last_run_at`` both schedulers would take "now" as the last run and wait an
hour).
"""

from __future__ import annotations

import datetime as dt
import os
import time
from typing import Any

from celery import Celery

TASK = "bench.record"

app = Celery("bench", broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("BENCH_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    # Celery's default; it also keeps every scheduler on its plain publish path.
    task_send_sent_event=False,
    beat_max_loop_interval=1,
    redbeat_redis_url=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
    redbeat_key_prefix=os.environ.get("BENCH_REDBEAT_PREFIX", "redbeat"),
)


@app.task(name=TASK)
def record(due: float, tag: str = "") -> float:
    """What a worker would run; the benchmarks only count and time messages."""
    return time.time() - due


def _beat_schedule(entries: int) -> dict[str, dict[str, Any]]:
    last_run = dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)
    now = time.time()
    return {
        f"bench-{i}": {
            "task": TASK,
            "schedule": dt.timedelta(hours=1),
            "args": (now, f"legacy-{i}"),
            "last_run_at": last_run,
        }
        for i in range(entries)
    }


_entries = int(os.environ.get("BENCH_BEAT_ENTRIES", "0"))
if _entries:
    app.conf.beat_schedule = _beat_schedule(_entries)
