"""The Celery project the chaos soak runs: one-off and periodic tasks that leave evidence.

Configured from the environment set by ``tests/e2e/harness.py`` (``E2E_BROKER_URL``,
``E2E_QUEUE``, ``E2E_PG_DSN``), the ``CELERY_SCHED_*`` settings and ``SOAK_MODE``
(``tests/soak/spec.py``): untracked workers get neither ``tracking.install`` nor
any ``celery_sched.Task`` task (``Task`` installs tracking), and the beats plan
only the mode's periodic schedules. Every
execution inserts a row into ``soak_runs`` when it starts (job id, key,
attempt, pid, host, time), so the checker can count runs; the
``celery_sched.Task`` tasks that have an effect write it into ``soak_effects``
inside ``self.ledger_transaction()``, so it must be there exactly once per key.
The evidence is written to the soak's own database, which the faults
disturb: writes reconnect and retry rather than fail the task.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from sqlalchemy import text

import celery_sched.tracking
from celery_sched import Task
from tests.soak.spec import parse_mode

MODE = parse_mode(os.environ.get("SOAK_MODE", "tracked"))

app = Celery("soak", broker=os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("E2E_QUEUE", "celery"),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=None,
    # Kombu's Redis transport gives an unacknowledged message (a late-acked
    # Task whose worker was killed) back after this long, instead of an hour.
    broker_transport_options={"visibility_timeout": 30},
    beat_max_loop_interval=1,
    beat_schedule={
        name: {"task": task, "schedule": every, "args": (name,)}
        for name, (task, every) in MODE.periodic.items()
    },
)
if MODE.tracked:
    celery_sched.tracking.install(app)

_local = threading.local()


def _write(statement: str, *params: Any) -> None:
    """One autocommit statement on this thread's connection, reconnecting
    through the soak's ``pg_terminate_backend`` faults."""
    for attempt in range(30):
        conn = getattr(_local, "conn", None)
        try:
            if conn is None or conn.closed:
                conn = _local.conn = psycopg.connect(
                    os.environ["E2E_PG_DSN"], autocommit=True, connect_timeout=5
                )
            conn.execute(statement, params)
            return
        except psycopg.OperationalError:
            _local.conn = None
            if attempt == 29:
                raise
            time.sleep(0.2)


def _record_start(task: Any) -> None:
    request = task.request
    _write(
        "INSERT INTO soak_runs VALUES (%s, %s, %s, %s, %s, %s, %s)",
        request.id,
        getattr(request, "celery_sched_key", None),
        task.name,
        int(getattr(request, "celery_sched_attempt", None) or 0),
        os.getpid(),
        request.hostname,
        time.time(),
    )


def _effect(task: Task) -> None:
    """The effect that must happen exactly once per key: committed with the
    ledger completion."""
    with task.ledger_transaction() as conn:
        conn.execute(
            text("INSERT INTO soak_effects VALUES (:key, :job_id, :pid, :at)"),
            {
                "key": getattr(task.request, "celery_sched_key", None),
                "job_id": task.request.id,
                "pid": os.getpid(),
                "at": time.time(),
            },
        )


# Task options: a fault (a terminated connection under ledger_transaction)
# makes an execution raise; it is retried rather than counted as the job's
# failure, and never often enough to kill a job.
TASK_OPTIONS: dict[str, Any] = {
    "base": Task,
    "bind": True,
    "max_attempts": 50,
    "default_retry_delay": 1,
}


@app.task(name="soak.plain", bind=True)
def plain(self: Any, hold: float = 0.0) -> None:
    """A plain task (at-least-once): records its start, then works ``hold`` s."""
    _record_start(self)
    time.sleep(hold)


@app.task(name="soak.periodic_plain", bind=True)
def periodic_plain(self: Any, name: str) -> None:
    _record_start(self)


if MODE.tracked:

    @app.task(name="soak.task", **TASK_OPTIONS)
    def task(self: Task, hold: float = 0.0) -> None:
        """A ``celery_sched.Task`` without an effect of its own."""
        _record_start(self)
        time.sleep(hold)

    @app.task(name="soak.effect", **TASK_OPTIONS)
    def effect(self: Task, hold: float = 0.0) -> None:
        """A ``celery_sched.Task`` whose effect is inside ``ledger_transaction``."""
        _record_start(self)
        time.sleep(hold)
        _effect(self)

    @app.task(name="soak.periodic_task", **TASK_OPTIONS)
    def periodic_task(self: Task, name: str) -> None:
        _record_start(self)
        _effect(self)
