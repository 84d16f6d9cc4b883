"""The Celery project that end-to-end tests run under real beat and worker processes.

Configured entirely from the environment (see ``tests/e2e/harness.py``). Each
execution is recorded in Postgres, in the test's own schema, so a Redis
FLUSHALL or a broker outage cannot erase the evidence.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery

import celery_sched.tracking

app = Celery("e2e", broker=os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("E2E_QUEUE", "celery"),
    worker_prefetch_multiplier=int(os.environ.get("E2E_PREFETCH", "16")),
    broker_connection_retry_on_startup=True,
    task_send_sent_event=True,
    worker_send_task_events=True,
    beat_max_loop_interval=1,
)
if os.environ.get("E2E_TRACKING", "1") == "1":
    celery_sched.tracking.install(app)

_local = threading.local()


def _conn() -> psycopg.Connection[Any]:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = _local.conn = psycopg.connect(os.environ["E2E_PG_DSN"], autocommit=True)
    return conn


@app.task(name="e2e.record", bind=True)
def record(self: Any, due: float, tag: str = "", hold: float = 0.0) -> None:
    """Record that this job ran: task id, key, due time and run time; then
    work ``hold`` seconds (a worker busy with it holds messages unacknowledged)."""
    ran = time.time()
    schema = os.environ["CELERY_SCHED_DB_SCHEMA"]
    row = (
        self.request.id,
        getattr(self.request, "celery_sched_key", None),
        tag,
        due,
        ran,
        self.request.hostname,
    )
    sql = (
        f'INSERT INTO "{schema}".e2e_runs (task_id, job_key, tag, due, ran, worker) '
        "VALUES (%s, %s, %s, %s, %s, %s)"
    )
    try:
        _conn().execute(sql, row)
    except psycopg.OperationalError:
        # The fault tests terminate every backend, this one's too: the
        # evidence must still be written, so reconnect once.
        _local.conn = None
        _conn().execute(sql, row)
    time.sleep(hold)
