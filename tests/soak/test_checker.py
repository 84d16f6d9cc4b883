"""The soak's checker judges a run from the workers' own evidence, not from job rows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from celery_sched.client import Client
from celery_sched.settings import Settings
from tests.soak.checker import FaultWindow, Manifest, check
from tests.soak.spec import TABLES

pytestmark = pytest.mark.integration


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    with Client(Celery("soak_checker"), settings=settings) as client:
        client.migrate()
        with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
            conn.execute(f'SET search_path TO "{settings.db_schema}"')
            for statement in TABLES:
                conn.execute(statement)
        yield client


def _schedule(client: Client, key: str) -> str:
    job = client.schedule("soak.plain", args=(0.0,), key=key, check_task=False)
    return str(job.id)


def _finish(settings: Settings, status: str, job_ids: list[str]) -> None:
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        conn.execute(
            f'UPDATE "{settings.db_schema}".jobs SET status = %s, attempt = 1, '
            "dispatched_at = now(), finished_at = now() WHERE id::text = ANY(%s)",
            (status, job_ids),
        )


def _ran(settings: Settings, job_id: str, key: str) -> None:
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{settings.db_schema}".soak_runs VALUES '
            "(%s, %s, 'soak.plain', 1, 1, 'w', extract(epoch FROM now()))",
            (job_id, key),
        )


def _check(settings: Settings, **manifest: Any) -> dict[str, Any]:
    given: dict[str, Any] = {"stream_start": 0.0, "stream_end": 0.0, "faults": []}
    return check(
        settings.libpq_conninfo(),
        Manifest(schedule_failures=[], **(given | manifest)),
        schema=settings.db_schema,
        evidence=settings.db_schema,
    )


def test_an_untracked_job_that_ends_sent_without_running_is_lost(
    client: Client, settings: Settings
) -> None:
    # Untracked workers report nothing: the reconciler marks every dispatched
    # job `sent`, whether or not a message reached a worker. Only the task's
    # own record of its start says it ran.
    ran, never = _schedule(client, "ran"), _schedule(client, "never-ran")
    _finish(settings, "sent", [ran, never])
    _ran(settings, ran, "ran")
    report = _check(
        settings, jobs={"ran": "soak.plain", "never-ran": "soak.plain"}, periodic={}, tracked=False
    )
    assert report["violation_counts"] == {"lost": 1}, report["violations"]
    assert report["violations"][0]["job"] == "never-ran"


def test_an_untracked_job_lost_with_the_broker_is_a_figure_not_a_violation(
    client: Client, settings: Settings
) -> None:
    # Past the broker, untracked workers get at-most-once delivery: a message
    # waiting in a broker that restarts empty is gone, as under stock beat.
    # Only a job published before such a fault is excused.
    in_broker, elsewhere = _schedule(client, "in-broker"), _schedule(client, "elsewhere")
    _finish(settings, "sent", [in_broker, elsewhere])
    now = time.time()
    restart = FaultWindow(kind="broker_restart", start=now + 5, end=now + 7, grace=5.0)
    kill = FaultWindow(kind="worker_kill", start=now + 5, end=now + 7, grace=5.0)
    report = _check(
        settings,
        jobs={"in-broker": "soak.plain"},
        periodic={},
        tracked=False,
        faults=[restart],
    )
    assert report["violation_counts"] == {} and report["lost_to_broker"] == 1
    report = _check(
        settings, jobs={"elsewhere": "soak.plain"}, periodic={}, tracked=False, faults=[kill]
    )
    assert report["violation_counts"] == {"lost": 1} and report["lost_to_broker"] == 0
    # Tracked workers get such a job sent again: never excused.
    report = _check(settings, jobs={"in-broker": "soak.plain"}, periodic={}, faults=[restart])
    assert report["violation_counts"] == {"not_succeeded": 1}


def test_a_tracked_job_ends_succeeded_and_a_sent_one_is_not_finished_right(
    client: Client, settings: Settings
) -> None:
    done, sent = _schedule(client, "done"), _schedule(client, "sent")
    _finish(settings, "succeeded", [done])
    _finish(settings, "sent", [sent])
    _ran(settings, done, "done")
    _ran(settings, sent, "sent")
    report = _check(settings, jobs={"done": "soak.plain", "sent": "soak.plain"}, periodic={})
    assert report["violation_counts"] == {"not_succeeded": 1}, report["violations"]


def test_a_cancelled_job_that_ran_and_a_future_job_that_ran_are_violations(
    client: Client, settings: Settings
) -> None:
    cancelled, future = _schedule(client, "cancelled"), _schedule(client, "future")
    assert client.cancel("cancelled")
    _ran(settings, cancelled, "cancelled")
    _ran(settings, future, "future")
    report = _check(
        settings,
        jobs={},
        periodic={},
        cancelled={"cancelled": "soak.plain"},
        future={"future": "soak.plain"},
    )
    assert report["violation_counts"] == {"cancelled_ran": 1, "future_ran": 1}
