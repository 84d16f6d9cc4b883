"""The Celery app of ``benchmarks/periodic.py``: one module for all three schedulers.

Configured only from the environment, so ``celery beat -S celery_sched``,
stock ``celery beat`` and ``celery-redbeat`` run the same app, broker, queue
and task:

- ``BENCH_BROKER_URL`` / ``BENCH_QUEUE``: the broker and the default queue.
- ``BENCH_PERIODIC_ENTRIES``: how many ``beat_schedule`` entries to define
  (for the stock schedulers; 0 for celery_sched, whose schedules are added to
  PostgreSQL through ``Client.schedules``).
- ``BENCH_PERIODIC_EVERY``: their interval in seconds (default 60).
- ``BENCH_PERIODIC_T0``: epoch seconds; entry ``i`` is first due at
  ``T0 + i * EVERY / ENTRIES``, so the entries' occurrences are spread evenly
  over each interval. Its ``last_run_at`` is set one interval earlier, which
  both stock beat and redbeat honour.
- ``BENCH_REDIS_URL`` / ``BENCH_REDBEAT_PREFIX``: redbeat's store and prefix.

Every message carries the entry's index as its only argument.
"""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from celery import Celery

TASK = "bench.periodic"

app = Celery(
    "bench_periodic", broker=os.environ.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/0")
)
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("BENCH_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    task_send_sent_event=False,
    beat_max_loop_interval=1,
    # No result backend: stock beat would add its daily backend_cleanup entry.
    result_expires=None,
    redbeat_redis_url=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
    redbeat_key_prefix=os.environ.get("BENCH_REDBEAT_PREFIX", "redbeat"),
)


@app.task(name=TASK)
def periodic(index: int) -> int:
    """What a worker would run; the benchmark only times the messages."""
    return index


def _beat_schedule(entries: int, every: float, t0: float) -> dict[str, dict[str, Any]]:
    schedule: dict[str, dict[str, Any]] = {}
    for i in range(entries):
        first_due = t0 + i * every / entries
        schedule[f"p{i:06d}"] = {
            "task": TASK,
            "schedule": dt.timedelta(seconds=every),
            "args": (i,),
            "last_run_at": dt.datetime.fromtimestamp(first_due - every, dt.UTC),
        }
    return schedule


_entries = int(os.environ.get("BENCH_PERIODIC_ENTRIES", "0"))
if _entries:
    app.conf.beat_schedule = _beat_schedule(
        _entries,
        float(os.environ.get("BENCH_PERIODIC_EVERY", "60")),
        float(os.environ["BENCH_PERIODIC_T0"]),
    )
