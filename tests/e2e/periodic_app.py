"""The Celery project of the periodic drop-in test: stock beat configuration only.

Every kind of periodic schedule beat knows, in ``beat_schedule`` and through
the task decorator, as an existing project would have them; nothing here
knows about celery_sched except ``base=celery_sched.Task`` on the decorated
tasks (and the ``clocked`` one-off). The test switches it over with
``celery beat -S celery_sched`` and the ``CELERY_SCHED_*`` settings in the
environment (see ``tests/e2e/harness.py``).

The test picks two instants and passes them in the environment: when the
clocked one-off fires (``E2E_CLOCKED_AT``) and the longitude at which the
sun's transit (``solar_noon``) falls inside the test (``E2E_SOLAR_LON``).
Each execution is recorded in Postgres, in the test's own schema, with its
job key (``<schedule name>@<nominal instant>``).
"""

from __future__ import annotations

import datetime as dt
import os
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from celery.schedules import crontab, schedule, solar

import celery_sched.tracking
from celery_sched import Task
from celery_sched.schedules import clocked

app = Celery("e2e_periodic", broker=os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("E2E_QUEUE", "celery"),
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=1,
    timezone="Europe/London",
)
celery_sched.tracking.install(app)

_CLOCKED_AT = os.environ.get("E2E_CLOCKED_AT", "2099-01-01T00:00:00+00:00")
_SOLAR_LON = float(os.environ.get("E2E_SOLAR_LON", "0"))

app.conf.beat_schedule = {
    "every-second": {"task": "periodic.record", "schedule": 1.0, "args": ("every-second",)},
    "two-seconds": {
        "task": "periodic.record",
        "schedule": dt.timedelta(seconds=2),
        "args": ("two-seconds",),
        "options": {"priority": 5, "expires": 60},
    },
    "cron-minute": {
        "task": "periodic.record",
        "schedule": crontab(minute="*"),
        "kwargs": {"tag": "cron-minute"},
    },
    "solar-noon": {
        "task": "periodic.record",
        "schedule": solar("solar_noon", 0.0, _SOLAR_LON),
        "args": ("solar-noon",),
    },
    "clocked-once": {
        "task": "periodic.record",
        "schedule": clocked(dt.datetime.fromisoformat(_CLOCKED_AT)),
        "args": ("clocked-once",),
    },
}


@app.on_after_configure.connect
def _more_entries(sender: Celery, **_: Any) -> None:
    # The other classic way to declare one.
    sender.add_periodic_task(
        schedule(dt.timedelta(seconds=3)), record.s("added-3s"), name="added-3s"
    )


_local = threading.local()


def _conn() -> psycopg.Connection[Any]:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = _local.conn = psycopg.connect(os.environ["E2E_PG_DSN"], autocommit=True)
    return conn


def _record(request: Any, tag: str) -> None:
    """One row per execution: task id, job key, tag, nominal time, run time."""
    key = getattr(request, "celery_sched_key", None)
    nominal = None
    if key and "@" in key:
        nominal = dt.datetime.fromisoformat(key.rsplit("@", 1)[1]).timestamp()
    schema = os.environ["CELERY_SCHED_DB_SCHEMA"]
    row = (request.id, key, tag, nominal, time.time(), request.hostname)
    sql = (
        f'INSERT INTO "{schema}".e2e_runs (task_id, job_key, tag, due, ran, worker) '
        "VALUES (%s, %s, %s, %s, %s, %s)"
    )
    try:
        _conn().execute(sql, row)
    except psycopg.OperationalError:
        _local.conn = None
        _conn().execute(sql, row)


@app.task(name="periodic.record", bind=True)
def record(self: Any, tag: str = "") -> None:
    """A plain task, scheduled from beat_schedule."""
    _record(self.request, tag)


@app.task(
    name="periodic.decorated_interval",
    bind=True,
    base=Task,
    schedule=2.0,
    schedule_args=("decorated-2s",),
)
def decorated_interval(self: Any, tag: str) -> None:
    """Declared with the decorator: every two seconds."""
    _record(self.request, tag)


@app.task(
    name="periodic.decorated_cron",
    bind=True,
    base=Task,
    schedule=crontab(minute="*"),
    schedule_name="decorated-cron",
    misfire="skip",
    overlap="skip",
)
def decorated_cron(self: Any) -> None:
    """Declared with the decorator: every minute, never overlapping itself."""
    _record(self.request, "decorated-cron")
