"""``sched pause / resume / trigger / delete / history / schedules --json / prune``
as real subprocesses against a real PostgreSQL."""

from __future__ import annotations

import dataclasses
import datetime as dt
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest

from celery_sched.client import Client
from celery_sched.models import JobStatus, ScheduleInfo
from celery_sched.schedules import spec_from_entry
from celery_sched.schedules.rows import schedule_row
from celery_sched.settings import Settings
from tests.integration import cli_app

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


def sched_env(schema: str, database_url: str, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CELERY_SCHED_DB_SCHEMA": schema,
        "CELERY_SCHED_DATABASE_URL": database_url,
        **extra,
    }


def sched(
    *args: str, schema: str, database_url: str, stdin: str | None = None, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.integration.cli_app sched ARGS`` (stdin: ``stdin``, else none)."""
    return subprocess.run(
        [CELERY, "-A", "tests.integration.cli_app", "sched", *args],
        cwd=ROOT,
        env=sched_env(schema, database_url, **extra),
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit status 1, one ``Error:`` line naming ``needles``, no traceback."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def add_static(client: Client, name: str) -> None:
    """A schedule as the leader's sync writes one from ``beat_schedule``."""
    spec = spec_from_entry(name, {"task": "cli_app.ping", "schedule": 3600}, app=cli_app.app)
    row = schedule_row(spec, client.builder, now=client.store.now())
    client.store.sync_static_schedules([row])


def test_pause_resume_trigger_history_delete(pg_url: str, pg_schema: str) -> None:
    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    run = dict(schema=pg_schema, database_url=pg_url)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        client.schedules.add("alpha", "cli_app.ping", 3600, kwargs={"x": 1})
        client.schedules.add("beta", "cli_app.ping", "*/5 * * * *")
        add_static(client, "from-code")

    result = sched("pause", "alpha", "beta", "from-code", **run)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["Paused alpha.", "Paused beta.", "Paused from-code."]

    # One unknown name: an error naming it, and nothing changes (alpha stays paused).
    one_line_error(sched("resume", "alpha", "nope", **run), "UnknownSchedule", "'nope'")
    with Client(cli_app.app, settings=settings, staging=False) as client:
        assert [info.paused for info in client.schedules.list()] == [True, True, True]

    result = sched("resume", "alpha", "beta", **run)
    assert result.returncode == 0, result.stderr
    assert "Resumed alpha; next run " in result.stdout

    result = sched("trigger", "alpha", **run)
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("alpha@") and key.endswith("Z")
    one_line_error(sched("trigger", "nope", **run), "UnknownSchedule", "'nope'")

    with Client(cli_app.app, settings=settings, staging=False) as client:
        job = client.get(key)
        assert job is not None and job.status == JobStatus.PENDING
        info = client.schedules.get("alpha")
        assert info is not None
        epoch = client.store.acquire_epoch(0, "cli test")
        [claimed] = client.store.claim_due(shard=0, epoch=epoch, limit=10)
        assert claimed.key == key
        client.store.mark_running(claimed.id, worker="w@test")
        client.store.mark_finished(claimed.id, JobStatus.SUCCEEDED)
        done = client.get(key)
        assert done is not None and done.dispatched_at is not None
        expected_lag = (done.dispatched_at - done.due_at).total_seconds()

    result = sched("history", "alpha", "--json", **run)
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)
    assert row["key"] == key and row["status"] == "succeeded"
    assert row["worker"] == "w@test"
    assert row["lag_seconds"] == pytest.approx(expected_lag)
    assert row["due_at"] <= row["dispatched_at"] <= row["started_at"] <= row["finished_at"]

    result = sched("history", "alpha", **run)
    assert result.returncode == 0, result.stderr
    header, line = result.stdout.splitlines()
    assert header.split() == ["due", "(UTC)", "sent", "started", "finished", "status", "lag"]
    assert "succeeded" in line and f"{expected_lag:.3f}s" in line
    result = sched("history", "beta", **run)
    assert result.returncode == 0 and "No occurrence of beta" in result.stdout
    one_line_error(sched("history", "nope", **run), "UnknownSchedule", "'nope'")

    # A schedule defined in code is refused (the manager's words) before
    # anything is deleted, even in company of deletable ones.
    one_line_error(
        sched("delete", "alpha", "from-code", "--yes", **run), "InvalidSchedule", "in the code"
    )
    # No --yes and no answer on stdin: aborted, nothing deleted.
    result = sched("delete", "alpha", **run)
    assert result.returncode == 1 and "Aborted" in result.stderr
    result = sched("delete", "alpha", "beta", stdin="y\n", **run)
    assert result.returncode == 0, result.stderr
    assert "Deleted alpha." in result.stdout and "Deleted beta." in result.stdout
    with Client(cli_app.app, settings=settings, staging=False) as client:
        assert [info.name for info in client.schedules.list()] == ["from-code"]
        assert client.get(key) is not None  # the finished history stays
    one_line_error(sched("delete", "alpha", "--yes", **run), "UnknownSchedule", "'alpha'")


def test_schedules_json_has_every_field(pg_url: str, pg_schema: str) -> None:
    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        client.schedules.add(
            "nightly", "cli_app.ping", "30 2 * * 1-5", timezone="Europe/Paris", queue="reports"
        )
        client.schedules.add("often", "cli_app.ping", 90, args=(1, "two"))
        client.schedules.pause("often")
    result = sched("schedules", "--json", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    fields = {field.name for field in dataclasses.fields(ScheduleInfo)}
    assert [set(row) for row in rows] == [fields | {"state"}] * 2
    nightly, often = rows
    assert nightly["spec"]["hour"] == "2" and nightly["timezone"] == "Europe/Paris"
    assert nightly["options"] == {"queue": "reports"} and nightly["state"] == "active"
    assert dt.datetime.fromisoformat(nightly["next_run_at"]).tzinfo is not None
    assert often["args"] == [1, "two"] and often["state"] == "paused"
    assert often["next_run_at"] is None


def _drain(controller: int, chunks: list[bytes]) -> None:
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the terminal's last writer is gone
            return
        if not chunk:
            return
        chunks.append(chunk)


def test_prune_shows_a_progress_bar_only_on_a_terminal(pg_url: str, pg_schema: str) -> None:
    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        client.schedule_many({"task": "cli_app.ping", "key": f"p{i}"} for i in range(5))
        for i in range(5):
            assert client.cancel(f"p{i}")
    env = sched_env(pg_schema, pg_url, CELERY_SCHED_PRUNE_BATCH="2")
    command = [CELERY, "-A", "tests.integration.cli_app", "sched", "prune", "--older-than", "0"]

    # stderr on a pseudo-terminal: the bar is drawn there, counting batches.
    controller, terminal = pty.openpty()
    # A new pseudo-terminal is 0 columns wide, where tqdm draws nothing.
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        # Read while the command runs: Linux drops what a pseudo-terminal
        # holds once its last writer is gone.
        chunks: list[bytes] = []
        reader = threading.Thread(target=_drain, args=(controller, chunks))
        reader.start()
        process = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=terminal,
            timeout=60,
        )
        os.close(terminal)
        reader.join(10)
        drawn = b"".join(chunks)
    finally:
        os.close(controller)
    assert process.returncode == 0, drawn
    assert b"Pruned 5 finished job(s)" in process.stdout
    assert b"Pruning jobs" in drawn and b"batches=3" in drawn

    # Not a terminal: the plain summary only.
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.schedule_many({"task": "cli_app.ping", "key": f"q{i}"} for i in range(3))
        for i in range(3):
            assert client.cancel(f"q{i}")
    result = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "Pruned 3 finished job(s)" in result.stdout
    assert "Pruning" not in result.stderr and "\r" not in result.stderr
