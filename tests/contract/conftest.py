"""Fixtures of the contract suites: every backend of an interface, one suite.

The ``store`` fixture yields each :class:`~celery_sched.interfaces.JobStore`
backend in turn. Both use a real clock (the memory store's default clock, and
Postgres ``now()``), so tests place jobs in the past or the far future relative
to ``store.now()`` and sleep briefly where a timeout must pass.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from celery_sched.interfaces import JobStore
from celery_sched.models import NewJob


def new_job(key: str, due_at: dt.datetime, **fields: Any) -> NewJob:
    """A valid job with a JSON protocol-2 body, due at ``due_at``."""
    body = json.dumps([[1, 2], {"flag": True}, {}]).encode()
    defaults: dict[str, Any] = {
        "id": uuid.uuid4(),
        "task": "tests.add",
        "body": body,
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "argsrepr": "(1, 2)",
        "kwargsrepr": "{'flag': True}",
        "options": {"queue": "celery", "priority": 3, "headers": {"h": "v"}},
    }
    defaults.update(fields)
    return NewJob(key=key, due_at=due_at, **defaults)


@pytest.fixture(params=["memory", "postgres"])
def store(request: pytest.FixtureRequest) -> Iterator[JobStore]:
    backend: JobStore
    if request.param == "memory":
        # Imported here so the postgres half runs even before memory.py exists.
        from celery_sched.store.memory import MemoryJobStore

        backend = MemoryJobStore()
    else:
        from celery_sched.store.postgres import PostgresJobStore

        backend = PostgresJobStore(request.getfixturevalue("settings"))
        backend.migrate()
    yield backend
    backend.close()
