"""``celery -A tests.integration.cli_app sched ...`` as a real subprocess."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from pathlib import Path

import pytest

from celery_sched.client import Client
from celery_sched.models import JobStatus
from celery_sched.settings import Settings
from tests.integration import cli_app

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


def run_sched(
    *args: str, schema: str, database_url: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CELERY_SCHED_DB_SCHEMA": schema,
        "CELERY_SCHED_DATABASE_URL": database_url,
        **(extra_env or {}),
    }
    return subprocess.run(
        [CELERY, "-A", "tests.integration.cli_app", "sched", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def counts_line(output: str, status: str) -> int:
    for line in output.splitlines():
        parts = line.split()
        if parts[:1] == [status]:
            return int(parts[1])
    raise AssertionError(f"no {status} line in:\n{output}")


def test_migrate_status_and_prune(pg_url: str, pg_schema: str) -> None:
    result = run_sched("migrate", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    assert f"'{pg_schema}'" in result.stdout
    assert "127.0.0.1:5432/test" in result.stdout
    assert "up to date" in result.stdout

    # Migrating again is a no-op that still succeeds.
    assert run_sched("migrate", schema=pg_schema, database_url=pg_url).returncode == 0

    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    base = dt.datetime(2031, 5, 1, 10, 0, tzinfo=dt.UTC)
    with Client(cli_app.app, settings=settings) as client:
        client.schedule_many(
            {"task": "cli_app.ping", "eta": base + dt.timedelta(minutes=20 * i), "key": f"k{i}"}
            for i in range(5)
        )
        assert client.cancel("k0")

    result = run_sched("status", "--by-hour", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    assert counts_line(result.stdout, "pending") == 4
    assert counts_line(result.stdout, "cancelled") == 1
    assert counts_line(result.stdout, "total") == 5
    assert "2031-05-01T10:00Z  3" in result.stdout
    assert "2031-05-01T11:00Z  2" in result.stdout

    result = run_sched(
        "status", "--by-hour", "--status", "pending", schema=pg_schema, database_url=pg_url
    )
    assert result.returncode == 0, result.stderr
    assert "2031-05-01T10:00Z  2" in result.stdout

    # The cancelled job finished just now: the default retention keeps it,
    # --older-than 0 removes it.
    result = run_sched("prune", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    assert "Pruned 0 " in result.stdout
    result = run_sched("prune", "--older-than", "0", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    assert "Pruned 1 " in result.stdout
    with Client(cli_app.app, settings=settings) as client:
        assert client.counts_by_status() == {JobStatus.PENDING: 4}


def test_reconcile_requeues_a_transaction_at_a_time_until_none_is_left(
    pg_url: str, pg_schema: str
) -> None:
    assert run_sched("migrate", schema=pg_schema, database_url=pg_url).returncode == 0
    result = run_sched("reconcile", schema=pg_schema, database_url=pg_url)
    assert result.returncode != 0
    assert "never had a leader" in result.stderr

    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    past = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=1)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.schedule_many(
            {"task": "cli_app.ping", "eta": past, "key": f"lost{i}"} for i in range(7)
        )
        epoch = client.store.acquire_epoch(0, "a leader that lost its messages")
        assert len(client.store.claim_due(shard=0, epoch=epoch, limit=100)) == 7
        client.store.heartbeat("worker@cli", 4242, tasks=["cli_app.ping"])  # tracked

    result = run_sched(
        "reconcile",
        "--limit",
        "3",
        schema=pg_schema,
        database_url=pg_url,
        extra_env={"CELERY_SCHED_VISIBILITY_TIMEOUT": "0.001"},
    )
    assert result.returncode == 0, result.stderr
    assert f"(epoch {epoch}): requeued 7 job(s), marked 0 dead; 0 of them" in result.stdout
    assert "0 no worker tracks marked sent" in result.stdout
    with Client(cli_app.app, settings=settings, staging=False) as client:
        assert client.counts_by_status() == {JobStatus.PENDING: 7}


def test_status_before_migrate_names_the_fix(pg_url: str, pg_schema: str) -> None:
    result = run_sched("status", schema=pg_schema, database_url=pg_url)
    assert result.returncode != 0
    assert "SchemaMissing" in result.stderr
    assert "sched migrate" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize(
    "url",
    [
        "mysql://admin:hunter2@127.0.0.1/test",
        "postgresql+psycopg://admin:hunter2@127.0.0.1:5432/",
        "postgresql+psycopg://admin:hunter2@127.0.0.1:notaport/test",
        "::not a url::",
    ],
)
def test_malformed_database_url_is_a_clean_error(url: str, pg_schema: str) -> None:
    result = run_sched("migrate", schema=pg_schema, database_url=url)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "Error:" in result.stderr
    assert "Traceback" not in output
    assert "hunter2" not in output


def test_unreachable_database_is_a_clean_error(pg_schema: str) -> None:
    url = "postgresql+psycopg://admin:hunter2@127.0.0.1:1/test"
    result = run_sched(
        "migrate",
        schema=pg_schema,
        database_url=url,
        extra_env={"CELERY_SCHED_CONNECT_RETRIES": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "StoreUnavailable" in result.stderr
    assert "Traceback" not in output
    assert "hunter2" not in output


def test_passwords_in_query_parameters_are_masked(pg_url: str, pg_schema: str) -> None:
    """Issue 13, defect 9. Before: ``?password=`` was printed as given."""
    sep = "&" if "?" in pg_url else "?"
    result = run_sched("migrate", schema=pg_schema, database_url=f"{pg_url}{sep}password=hunter2")
    assert result.returncode == 0, result.stderr
    assert "password=***" in result.stdout
    assert "hunter2" not in result.stdout + result.stderr
    unreachable = "postgresql+psycopg://admin@127.0.0.1:1/test?password=hunter2&sslpassword=hunter3"
    result = run_sched(
        "migrate",
        schema=pg_schema,
        database_url=unreachable,
        extra_env={"CELERY_SCHED_CONNECT_RETRIES": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "StoreUnavailable" in result.stderr
    assert "hunter2" not in output and "hunter3" not in output


def test_schedules_of_a_pickle_app_are_listed_and_refused_where_not_accepted(
    pg_url: str, pg_schema: str
) -> None:
    """Issue 13, defect 8. Before: ``sched schedules`` crashed on a pickle app
    (rows were decoded with accept=None, which refuses pickle)."""
    from celery import Celery

    app = Celery("cli_app", set_as_current=False)
    app.conf.update(timezone="UTC", task_serializer="pickle", accept_content=["pickle", "json"])
    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    with Client(app, settings=settings, staging=False) as client:
        client.migrate()
        client.schedules.add("rich", "cli_app.ping", 60, args=({1, 2},), check_task=False)
    result = run_sched(
        "schedules",
        schema=pg_schema,
        database_url=pg_url,
        extra_env={"CLI_APP_SERIALIZER": "pickle"},
    )
    assert result.returncode == 0, result.stderr
    assert "rich" in result.stdout and "interval" in result.stdout
    # The same rows for an app that accepts JSON only: never unpickled, and
    # since #30 (finding 9) listed as broken with the reason instead of
    # failing the whole listing.
    result = run_sched("schedules", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    assert "broken" in result.stdout
    assert "application/x-python-serialize" in result.stdout
    assert "accept_content" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
