"""Periodic schedules on a real PostgreSQL: planner, racing planners, Client.schedules, CLI."""

from __future__ import annotations

import dataclasses
import threading

import psycopg
import pytest
from celery.schedules import crontab

from celery_sched import schedules
from celery_sched.client import Client
from celery_sched.errors import ScheduleExists, UnknownTimezone
from celery_sched.leader.planning import Planner
from celery_sched.models import JobStatus
from celery_sched.schedules.rows import schedule_row
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore
from tests.integration import cli_app
from tests.integration.test_cli import run_sched

pytestmark = pytest.mark.integration


@pytest.fixture
def client(store: PostgresJobStore, settings: Settings) -> Client:
    return Client(cli_app.app, settings=settings, store=store, staging=False)


def occurrence_keys(settings: Settings) -> list[str]:
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT key FROM "{settings.db_schema}".jobs WHERE schedule_id IS NOT NULL'
        ).fetchall()
    return [row[0] for row in rows]


def test_planner_materializes_occurrences(client: Client, store: PostgresJobStore) -> None:
    info = client.schedules.add("every5", "cli_app.ping", 5, queue="periodic", expires=30)
    client.schedules.add("cron", "cli_app.ping", crontab(minute="*"))
    planner = Planner(store, client.settings, app=cli_app.app)
    result = planner.plan_pass()
    assert result.schedules == 2
    keys = occurrence_keys(client.settings)
    every5 = sorted(k for k in keys if k.startswith("every5@"))
    assert len(every5) == 24  # 120 s horizon / 5 s
    assert info.next_run_at is not None
    assert every5[0] == schedules.occurrence_key("every5", info.next_run_at)
    job = store.get(every5[0])
    # expires counts from the send (as stock beat counts it): kept as seconds
    assert job is not None and job.options == {"queue": "periodic", "expires": 30.0}
    assert job.expires_at is None
    assert 2 <= sum(k.startswith("cron@") for k in keys) <= 3
    # A second pass right away has nothing to add.
    assert planner.plan_pass().written == []
    listed = {i.name: i for i in client.schedules.list()}
    assert listed["every5"].next_run_at == info.next_run_at


def test_concurrent_planners_never_duplicate(client: Client, store: PostgresJobStore) -> None:
    client.schedules.add_many(
        {"name": f"s{i}", "task": "cli_app.ping", "schedule": 1 + i % 7} for i in range(300)
    )
    settings = client.settings
    stores = [PostgresJobStore(settings) for _ in range(3)]
    errors: list[BaseException] = []
    written: list[int] = []
    barrier = threading.Barrier(len(stores))

    def plan(own: PostgresJobStore) -> None:
        try:
            planner = Planner(own, settings, app=cli_app.app)
            barrier.wait()
            for _ in range(3):
                written.append(len(planner.plan_pass().written))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=plan, args=(own,)) for own in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for own in stores:
        own.close()
    assert errors == []
    keys = occurrence_keys(settings)
    assert len(keys) == len(set(keys))
    assert sum(written) == len(keys) > 300 * 17  # every interval of at most 7 s, 120 s ahead


def test_client_schedules_round_trip(client: Client, store: PostgresJobStore) -> None:
    client.schedules.add("r", "cli_app.ping", "*/10 * * * *", timezone="Europe/London")
    with pytest.raises(ScheduleExists):
        client.schedules.add("r", "cli_app.ping", 10)
    with pytest.raises(UnknownTimezone):
        client.schedules.add("tz", "cli_app.ping", 10, timezone="Europe/Atlantis")
    assert [i.name for i in client.schedules.list()] == ["r"]
    updated = client.schedules.update("r", schedule=crontab(minute="*/20"), priority=3)
    assert updated.spec["minute"] == "*/20" and updated.options == {"priority": 3}
    assert updated.timezone == "Europe/London"
    assert client.schedules.pause("r").state == "paused"
    job = client.schedules.trigger("r")
    assert job is not None and job.status == JobStatus.PENDING
    assert store.get(job.key) is not None
    assert client.schedules.resume("r").state == "active"
    assert client.schedules.delete("r") is True
    assert client.schedules.get("r") is None
    assert store.get(job.key) is not None  # the history stays


def test_static_sync_of_many_entries(store: PostgresJobStore, settings: Settings) -> None:
    app = cli_app.app
    specs = [
        schedules.make_spec(f"e{i}", "cli_app.ping", 60, app=app, source="static")
        for i in range(2000)
    ]
    planner = Planner(store, settings, app=app, static=specs)
    assert planner.sync_static().added == 2000
    again = planner.sync_static()
    assert (again.added, again.updated, again.unchanged) == (0, 0, 2000)
    planner.static = specs[:1500]
    assert planner.sync_static().disabled == 500
    assert store.count_schedules() == {"active": 1500, "disabled": 500}


def test_cli_lists_schedules(client: Client, pg_url: str, pg_schema: str) -> None:
    client.schedules.add("alpha", "cli_app.ping", 30)
    client.schedules.add("beta", "cli_app.ping", crontab(minute="0"))
    client.schedules.pause("beta")
    result = run_sched("schedules", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["name", "kind", "next"]
    alpha = next(line for line in lines if line.startswith("alpha"))
    beta = next(line for line in lines if line.startswith("beta"))
    assert "interval" in alpha and alpha.rstrip().endswith("active")
    assert "crontab" in beta and beta.rstrip().endswith("paused")
    assert "1 active, 1 paused" in lines[-1]


def test_an_unplannable_schedule_is_broken_and_shown(
    client: Client, store: PostgresJobStore, pg_url: str, pg_schema: str
) -> None:
    # Issue 13: a stored `expires` of 3e11 s (past datetime.max) raised
    # OverflowError in every planning pass of every leader. Stored through the
    # store, as an older version or a hand edit could have, past validation.
    client.schedules.add("before", "cli_app.ping", 5)
    spec = schedules.make_spec("far", "cli_app.ping", 5, app=cli_app.app)
    row = schedule_row(spec, client.builder, now=store.now())
    store.add_schedules([dataclasses.replace(row, options={"expires": 3e11})])
    client.schedules.add("later", "cli_app.ping", 5)
    planner = Planner(store, client.settings, app=cli_app.app)
    result = planner.plan_pass()
    assert result.broken == 1 and result.schedules == 3
    keys = occurrence_keys(client.settings)
    assert sum(k.startswith("before@") for k in keys) == 24
    assert sum(k.startswith("later@") for k in keys) == 24
    assert not any(k.startswith("far@") for k in keys)
    info = client.schedules.get("far")
    assert info is not None and info.state == "broken" and info.broken_at is not None
    reason = "InvalidSchedule: schedule 'far': expires 3e+11 s after"
    assert info.broken_reason is not None and info.broken_reason.startswith(reason)
    assert client.schedules.counts() == {"active": 2, "broken": 1}
    assert planner.plan_pass().schedules == 0  # left out until a change

    result = run_sched("schedules", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    far = next(line for line in lines if line.startswith("far "))
    assert far.rstrip().endswith("broken")
    shown = next(line for line in lines if line.strip().startswith("far  since"))
    assert reason in shown and "past the latest date" in shown
    assert "2 active, 1 broken" in lines[-1]

    fixed = client.schedules.update("far", expires=60)
    assert fixed.state == "active" and fixed.broken_reason is None
    assert planner.plan_pass().written
    job = store.get(schedules.occurrence_key("far", fixed.next_run_at))  # type: ignore[arg-type]
    assert job is not None and job.expires_at is None and job.options["expires"] == 60
