"""``celery -A ... sched jobs|job|dead|requeue|cancel|leader`` as real subprocesses,
against a real PostgreSQL (and a real Redis and beat for ``leader``)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import subprocess
import time
from typing import Any

import pytest

from celery_sched.backends import build_ledger
from celery_sched.client import Client
from celery_sched.models import JobStatus
from celery_sched.settings import Settings
from tests.e2e.harness import CELERY, ROOT, settings_env, wait_for
from tests.integration import cli_app
from tests.integration.test_cli import run_sched

pytestmark = pytest.mark.integration

BASE = dt.datetime(2031, 5, 1, 10, 0, tzinfo=dt.UTC)


def settings_for(pg_url: str, schema: str) -> Settings:
    return Settings(database_url=pg_url, db_schema=schema)


def sched_json(*args: str, schema: str, database_url: str) -> Any:
    result = run_sched(*args, "--json", schema=schema, database_url=database_url)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def make_dead(client: Client, keys: list[str]) -> None:
    """Jobs of ``keys`` dispatched once (attempt 0) and given up on by the
    reconciler (max_attempts 1): dead at attempt 1."""
    past = client.store.now() - dt.timedelta(minutes=5)
    client.schedule_many(
        {"task": "cli_app.ping", "eta": past, "key": key, "max_attempts": 1} for key in keys
    )
    store = client.store
    epoch = store.acquire_epoch(0, "test leader")
    assert len(store.claim_due(shard=0, epoch=epoch, limit=1000)) >= len(keys)
    store.heartbeat("worker@cli", 4242, tasks=["cli_app.ping"])
    store.reconcile(shard=0, epoch=epoch, limit=1000, default_visibility_timeout=0.0)


def test_jobs_pages_through_every_job_once_with_filters(pg_url: str, pg_schema: str) -> None:
    settings = settings_for(pg_url, pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        client.schedule_many(
            {"task": "cli_app.ping", "eta": BASE + dt.timedelta(minutes=i % 7), "key": f"k{i:02d}"}
            for i in range(17)
        )
        client.schedule_many(
            {
                "task": "cli_app.ping",
                "eta": BASE + dt.timedelta(hours=1, seconds=i),
                "key": f"night@{i}",
            }
            for i in range(3)
        )
        assert client.cancel("k03")

    seen: list[dict[str, Any]] = []
    cursor: str | None = None
    pages = 0
    while True:
        extra = ("--after", cursor) if cursor else ()
        page = sched_json("jobs", "--limit", "6", *extra, schema=pg_schema, database_url=pg_url)
        seen += page["jobs"]
        pages += 1
        cursor = page["next"]
        if cursor is None:
            break
    assert pages == 4
    keys = [job["key"] for job in seen]
    assert len(keys) == len(set(keys)) == 20
    order = [(job["due_at"], job["id"]) for job in seen]
    assert order == sorted(order)
    assert {job["status"] for job in seen} == {"pending", "cancelled"}
    first = seen[0]
    assert {"attempt", "max_attempts", "last_error", "shard", "options"} <= set(first)

    page = sched_json(
        "jobs",
        "--status",
        "pending",
        "--key-prefix",
        "night@",
        "--due-after",
        "2031-05-01T10:30:00",  # naive: UTC
        "--newest",
        schema=pg_schema,
        database_url=pg_url,
    )
    assert [job["key"] for job in page["jobs"]] == ["night@2", "night@1", "night@0"]
    assert page["next"] is None
    page = sched_json(
        "jobs",
        "--status",
        "cancelled",
        "--status",
        "dead",
        "--task",
        "cli_app.ping",
        schema=pg_schema,
        database_url=pg_url,
    )
    assert [job["key"] for job in page["jobs"]] == ["k03"]

    # The human table ends with the next page's cursor.
    result = run_sched(
        "jobs", "--due-before", "2031-05-01T10:01:00Z", "--limit", "2", schema=pg_schema,
        database_url=pg_url,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["key", "task", "status", "due", "(UTC)", "attempt", "shard"]
    assert "2031-05-01 10:00:00Z" in lines[1] and "0/5" in lines[1]
    assert "next page: --after " in lines[-1]


def test_job_shows_every_field_its_arguments_and_its_message_headers(
    pg_url: str, pg_schema: str
) -> None:
    settings = settings_for(pg_url, pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        client.schedule(
            "cli_app.ping",
            args=(1, "two"),
            kwargs={"x": 3},
            eta=BASE,
            key="shown",
            headers={"trace": "abc"},
            time_limit=30,
        )
    shown = sched_json("job", "shown", schema=pg_schema, database_url=pg_url)
    assert shown["key"] == "shown" and shown["status"] == "pending"
    assert (shown["attempt"], shown["max_attempts"], shown["last_error"]) == (0, 5, None)
    assert shown["args"] == [1, "two"] and shown["kwargs"] == {"x": 3}
    headers = shown["headers"]
    assert headers["id"] == shown["id"] and headers["task"] == "cli_app.ping"
    assert headers["celery_sched_key"] == "shown"
    assert headers["celery_sched_attempt"] == 0
    assert headers["celery_sched_epoch"] == 0  # no leader yet
    assert headers["trace"] == "abc"
    assert headers["timelimit"] == [30, None]
    assert headers["argsrepr"] == "(1, 'two')"

    result = run_sched("job", "shown", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    assert "celery_sched_key: shown" in result.stdout
    assert "last_error" in result.stdout


def test_dead_requeue_and_the_fence_after_it(pg_url: str, pg_schema: str) -> None:
    settings = settings_for(pg_url, pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        make_dead(client, ["started", "adopted", *[f"bulk{i}" for i in range(5)]])
        client.schedule("cli_app.ping", eta=BASE, key="waiting")

    dead = sched_json("dead", "--limit", "4", schema=pg_schema, database_url=pg_url)
    assert len(dead["jobs"]) == 4 and dead["next"]
    rest = sched_json("dead", "--after", dead["next"], schema=pg_schema, database_url=pg_url)
    assert {job["key"] for job in dead["jobs"] + rest["jobs"]} == {
        "started", "adopted", *{f"bulk{i}" for i in range(5)}
    }  # fmt: skip
    assert all(job["status"] == "dead" and job["attempt"] == 1 for job in rest["jobs"])

    result = run_sched(
        "requeue", "started", "adopted", "waiting", "ghost", schema=pg_schema, database_url=pg_url
    )
    assert result.returncode == 1
    assert "requeued started: attempt 2, max_attempts 3" in result.stdout
    assert "not requeued waiting: it is pending" in result.stdout
    assert "unknown ghost" in result.stdout
    assert "Requeued 2 job(s)." in result.stdout
    assert result.stderr.strip().splitlines() == ["Error: 1 unknown key(s): 'ghost'"]

    ledger = build_ledger(settings)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        started, adopted = client.get("started"), client.get("adopted")
        assert started is not None and adopted is not None
        # Pending again, due now, one attempt on, a fresh allowance of max_attempts (1).
        assert (started.status, started.attempt, started.max_attempts) == (JobStatus.PENDING, 2, 3)
        assert started.finished_at is None and started.last_error  # the history is kept
        assert abs(started.due_at - client.store.now()) < dt.timedelta(seconds=30)
        try:
            # The new attempt started: the old attempt's late message is refused.
            assert client.store.mark_running(started.id, worker="w", worker_pid=1)
            check = ledger.check_delivery(started.id, 0)
            assert check.reason == "attempt 0 is older than the job's attempt 2"
            # Nobody started it yet: the late message takes it over as a new
            # attempt, and the requeued attempt's own message is then refused,
            # so the job runs once either way.
            check = ledger.check_delivery(adopted.id, 0)
            assert check.reason is None and check.adopted == 3
            assert ledger.check_delivery(adopted.id, 2).reason == (
                "attempt 2 is older than the job's attempt 3"
            )
        finally:
            ledger.close()

    result = run_sched(
        "requeue", "--all-dead", "--batch", "2", "--json", schema=pg_schema, database_url=pg_url
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"requeued": 5, "task": None}
    with Client(cli_app.app, settings=settings, staging=False) as client:
        counts = client.counts_by_status()
        assert counts.get(JobStatus.DEAD, 0) == 0
        bulk = client.get("bulk3")
        assert bulk is not None and (bulk.status, bulk.attempt) == (JobStatus.PENDING, 2)


def test_cancel_reports_each_key_and_fails_on_an_unknown_one(pg_url: str, pg_schema: str) -> None:
    settings = settings_for(pg_url, pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        for key in ("a", "b"):
            client.schedule("cli_app.ping", eta=BASE, key=key)
        assert client.cancel("b")
    result = run_sched("cancel", "a", "b", "nope", "--json", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 1
    assert json.loads(result.stdout) == {
        "cancelled": ["a"],
        "not_cancellable": {"b": "cancelled"},
        "unknown": ["nope"],
    }
    assert "Traceback" not in result.stderr
    with Client(cli_app.app, settings=settings, staging=False) as client:
        job = client.get("a")
        assert job is not None and job.status is JobStatus.CANCELLED
    result = run_sched("cancel", "a", schema=pg_schema, database_url=pg_url)
    assert result.returncode == 0, result.stderr
    assert "not cancelled a: it is cancelled" in result.stdout


def test_bad_input_is_one_line_and_writes_nothing(pg_url: str, pg_schema: str) -> None:
    with Client(cli_app.app, settings=settings_for(pg_url, pg_schema), staging=False) as client:
        client.migrate()
        client.schedule("cli_app.ping", eta=BASE, key="kept")
    cases = [
        (("jobs", "--after", "not-a-cursor"), "InvalidCursor"),
        (("jobs", "--due-after", "yesterday"), "is not an ISO 8601 time"),
        (("jobs", "--status", "lost"), "'lost' is not one of"),
        (("jobs", "--due-after", "2031-01-02", "--due-before", "2031-01-01"), "earlier than"),
        (("jobs", "--limit", "0"), "--limit"),
        (("job", "ghost"), "no job with key 'ghost'"),
        (("requeue",), "give job keys or --all-dead"),
        (("requeue", "kept", "--task", "t"), "--task goes with --all-dead"),
        (("requeue", "kept", "--attempts", "0"), "--attempts"),
        (("dead", "--after", "AAAA"), "InvalidCursor"),
    ]
    for args, reason in cases:
        result = run_sched(*args, schema=pg_schema, database_url=pg_url)
        assert result.returncode != 0, args
        assert reason in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout, args
        errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, (args, result.stderr)
    with Client(cli_app.app, settings=settings_for(pg_url, pg_schema), staging=False) as client:
        kept = client.get("kept")
        assert kept is not None and kept.status is JobStatus.PENDING and kept.attempt == 0


def test_leader_shows_a_running_beat(redis_url: str, make_cluster: Any, e2e_settings: Any) -> None:

    settings = dataclasses.replace(e2e_settings, shards=2)
    cluster = make_cluster(redis_url, settings)
    # Pinned to shard 0, so shard 1 has no leader.
    beat = cluster.start_beat(CELERY_SCHED_SHARDS="2", CELERY_SCHED_SHARD="0")
    wait_for(cluster.leader, timeout=30, what="a leader")
    env = {
        **os.environ,
        **settings_env(settings),
        "CELERY_SCHED_SHARDS": "2",
        "PYTHONPATH": str(ROOT),
        "E2E_BROKER_URL": redis_url,
        "E2E_QUEUE": cluster.queue,
    }

    def leader() -> Any:
        result = subprocess.run(
            [CELERY, "-A", cluster.app, "sched", "leader", "--json"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["shards"]

    def led() -> Any:
        shards = leader()
        return shards if shards[0]["last_pass_at"] is not None else None

    shards = wait_for(led, timeout=30, what="a leader report")
    first, second = shards
    host_pid = first["leader"]
    assert host_pid is not None and host_pid.endswith(f":{beat.pid}")
    assert first["epoch"] >= 1
    assert 0 < first["lease_ttl"] <= settings.lease_ttl
    assert first["last_pass_by"] == host_pid
    assert first["last_pass_epoch"] == first["epoch"]
    assert first["last_pass_ago"] < 10
    # Shard 1 has no beat: nobody leads it, no pass.
    assert second == {
        "shard": 1,
        "leader": None,
        "epoch": 0,
        "lease_ttl": None,
        "last_pass_at": None,
        "last_pass_ago": None,
        "last_pass_by": None,
        "last_pass_epoch": None,
    }
    # The report moves on with the passes.
    time.sleep(1.5)
    again = leader()[0]
    assert again["last_pass_at"] > first["last_pass_at"]
