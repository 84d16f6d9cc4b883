"""The Celery project of the worker-side end-to-end tests: celery_sched.Task tasks.

Configured from the environment like ``tests/e2e/app.py`` (see
``tests/e2e/harness.py``). Every delivery, outcome and side effect is written
to Postgres in the test's own schema, so a killed worker cannot take the
evidence with it. A key listed in the ``kill_once`` table makes the worker
running it kill itself (SIGKILL) once, at the point the task names.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import psycopg
from celery import Celery, signals
from sqlalchemy import text

from celery_sched import Task

app = Celery("e2e_tasks", broker=os.environ.get("E2E_BROKER_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_default_queue=os.environ.get("E2E_QUEUE", "celery"),
    worker_prefetch_multiplier=4,
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=1,
)

if os.environ.get("E2E_EVERY_SECOND") == "1":
    # A periodic Task schedule for the tests that need one (the clock jump):
    # its occurrences are keyed `every-second@<instant>`, like any job.
    app.conf.beat_schedule = {
        "every-second": {"task": "tasks.effect", "schedule": 1.0, "args": ("every-second",)}
    }

#: Tables the tests read; created by the test before any process starts.
TABLES = (
    "CREATE TABLE {s}.effects (key text, task_id text, note text)",
    "CREATE TABLE {s}.deliveries (task_id text, key text, redelivered boolean, "
    "retries int, at double precision)",
    "CREATE TABLE {s}.outcomes (task_id text, key text, state text, retval text)",
    "CREATE TABLE {s}.kill_once (key text PRIMARY KEY)",
)

_local = threading.local()


def _schema() -> str:
    return '"' + os.environ["CELERY_SCHED_DB_SCHEMA"] + '"'


def _conn() -> psycopg.Connection[Any]:
    conn = getattr(_local, "conn", None)
    if conn is None or conn.closed:
        conn = _local.conn = psycopg.connect(os.environ["E2E_PG_DSN"], autocommit=True)
    return conn


def _sql(statement: str, *params: Any) -> list[tuple[Any, ...]]:
    cur = _conn().execute(statement.replace("{s}", _schema()), params)
    return cur.fetchall() if cur.description else []


def _die_if_listed(key: str | None) -> None:
    """SIGKILL this worker if ``key`` is listed in kill_once (consuming the entry)."""
    if key and _sql("DELETE FROM {s}.kill_once WHERE key = %s RETURNING key", key):
        os.kill(os.getpid(), signal.SIGKILL)


def _key(task: Any) -> str | None:
    return getattr(task.request, "celery_sched_key", None)


@signals.task_prerun.connect
def _record_delivery(task_id: str | None = None, task: Any = None, **_: Any) -> None:
    if task is None or task.app is not app:
        return
    redelivered = bool((task.request.delivery_info or {}).get("redelivered"))
    _sql(
        "INSERT INTO {s}.deliveries VALUES (%s, %s, %s, %s, %s)",
        task_id,
        _key(task),
        redelivered,
        task.request.retries,
        time.time(),
    )


@signals.task_postrun.connect
def _record_outcome(
    task_id: str | None = None,
    task: Any = None,
    retval: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    if task is None or task.app is not app:
        return
    try:
        shown = json.dumps(retval)
    except TypeError:
        shown = repr(retval)
    _sql("INSERT INTO {s}.outcomes VALUES (%s, %s, %s, %s)", task_id, _key(task), state, shown)
    if task.name == "tasks.effect":
        # After the ledger completion, before the (late) acknowledgement.
        _die_if_listed(_key(task))


@app.task(name="tasks.effect", base=Task, bind=True)
def effect(self: Task, tag: str, hold: float = 0.0) -> dict[str, str]:
    """A side effect outside any transaction, then ``hold`` seconds of work."""
    _sql("INSERT INTO {s}.effects VALUES (%s, %s, %s)", _key(self), self.request.id, tag)
    time.sleep(hold)
    return {"tag": tag}


@app.task(name="tasks.effect_vt", base=Task, bind=True, visibility_timeout=3)
def effect_vt(self: Task, tag: str) -> dict[str, str]:
    """:func:`effect` with a 3-second visibility timeout for its scheduled jobs."""
    _sql("INSERT INTO {s}.effects VALUES (%s, %s, %s)", _key(self), self.request.id, tag)
    return {"tag": tag}


@app.task(name="tasks.transfer", base=Task, bind=True)
def transfer(self: Task, amount: int) -> int:
    """A write committed together with the ledger completion."""
    with self.ledger_transaction() as conn:
        conn.execute(
            text(f"INSERT INTO {_schema()}.effects VALUES (:key, :task_id, :note)"),
            {"key": _key(self), "task_id": self.request.id, "note": f"transfer {amount}"},
        )
        # Between the write and the commit.
        _die_if_listed(_key(self))
    return amount


@app.task(name="tasks.always_fails", base=Task, bind=True, max_attempts=3, default_retry_delay=0.5)
def always_fails(self: Task) -> None:
    """Fails every time, recording each attempt."""
    _sql("INSERT INTO {s}.effects VALUES (%s, %s, %s)", _key(self), self.request.id, "attempt")
    raise RuntimeError("the card was declined again")
