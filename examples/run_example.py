"""celery_sched end to end: schedule jobs, run two beats and a worker, watch them run.

Run it with ``./scripts/example.sh``, or ``python examples/run_example.py``.
It uses PostgreSQL, Redis and the broker (RabbitMQ) at the configured URLs
(``CELERY_SCHED_DATABASE_URL``, ``CELERY_SCHED_REDIS_URL``,
``CELERY_BROKER_URL``; 127.0.0.1 by default). When any of them does not
answer, it starts the dev server instead (``python -m celery_sched dev``:
PostgreSQL and Redis from the ``celery_sched[dev]`` wheels, its Redis also
the broker) in ``examples/.celery_sched-dev`` and stops it at the end, so a
machine with only Python runs it too. It works in its own schema,
``celery_sched_example``, which it drops at the start so that every run
begins from nothing. ``--jobs`` and ``--soon`` make it smaller. Two parts:

1. Schedule 100,000 reminders over the next 24 hours in one bulk call and
   show how they are stored (counts per status and per hour).
2. Start two ``celery -A proj beat -S celery_sched`` processes (one becomes
   the leader, the other waits as a standby) and one ``celery -A proj worker``,
   schedule a few thousand jobs due over the next seconds, and print the
   counts per status until every one of them has run.
3. Meanwhile the leader has synced the project's periodic schedules
   (``beat_schedule`` in ``proj/celery_app.py`` and the decorated tasks in
   ``proj/periodic.py``) and fires them; show them with their last and next
   runs, then add, trigger and pause one at runtime through
   ``Client.schedules``. Everything started here is stopped before the
   script exits.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kombu
import psycopg
import redis
from kombu.utils.url import maybe_sanitize_url
from proj.celery_app import app
from proj.tasks import send_reminder
from psycopg import sql

from celery_sched import Client, JobStatus
from celery_sched import dev as devserver
from celery_sched.errors import DevServerError
from celery_sched.settings import Settings

SCHEMA = "celery_sched_example"
JOB_COUNT = 100_000
HORIZON = dt.timedelta(hours=24)
SOON_COUNT = 3_000
SOON_SPREAD = 10.0  # seconds over which the "soon" jobs fall due
#: Where the web console (`sched web`) listens while the example runs.
WEB_PORT = int(os.environ.get("EXAMPLE_WEB_PORT", "8808"))
EXAMPLES = Path(__file__).resolve().parent


def unanswered() -> list[str]:
    """The configured services that do not answer, each with its sanitized URL."""
    settings = Settings.from_app(app)
    missing = []
    try:
        psycopg.connect(settings.libpq_conninfo(), connect_timeout=3).close()
    except psycopg.Error:
        missing.append(f"PostgreSQL at {settings.safe_database_url}")
    try:
        with redis.Redis.from_url(settings.redis_url, socket_timeout=3) as client:
            client.ping()
    except redis.RedisError:
        missing.append(f"Redis at {settings.safe_redis_url}")
    broker = app.conf.broker_url
    try:
        with kombu.Connection(broker, connect_timeout=3) as conn:
            conn.connect()
    except Exception:  # each transport raises its own errors
        missing.append(f"the broker at {maybe_sanitize_url(broker)}")
    return missing


@contextlib.contextmanager
def services(dev_data_dir: Path) -> Iterator[None]:
    """Use the configured services, or the dev server when any does not answer."""
    missing = unanswered()
    if not missing:
        yield
        return
    print(f"{', '.join(missing)} did not answer;")
    print(f"starting the dev server (python -m celery_sched dev) in {dev_data_dir}")
    try:
        server = devserver.start(dev_data_dir)
    except DevServerError as exc:
        raise SystemExit(f"run_example.py: {exc}") from exc
    # The beats and the worker started below inherit these.
    os.environ.update(server.environment())
    app.conf.broker_url = server.broker_url
    print(f"  PostgreSQL {maybe_sanitize_url(server.database_url)}")
    print(
        f"  Redis      {maybe_sanitize_url(server.redis_url)} "
        f"(broker: {maybe_sanitize_url(server.broker_url)})\n"
    )
    try:
        yield
    finally:
        if server.started:
            devserver.stop(dev_data_dir)
            print("stopped the dev server.")


def drop_schema() -> None:
    """Drop the example schema so that a rerun starts clean."""
    conninfo = Settings.from_app(app).libpq_conninfo()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(SCHEMA)))


def reminders(start: dt.datetime, count: int) -> Iterator[dict[str, Any]]:
    """One reminder per user, due at a random moment within ``HORIZON``."""
    rng = random.Random(2024)  # a fixed seed keeps the printed counts stable
    for user_id in range(count):
        yield {
            "task": send_reminder.name,
            "args": (user_id, "your trial ends soon"),
            "eta": start + rng.random() * HORIZON,
            # A key per job: scheduling the same reminder twice is refused.
            "key": f"reminder:{user_id}",
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=JOB_COUNT, help="jobs over the next 24 h")
    parser.add_argument("--soon", type=int, default=SOON_COUNT, help="jobs due within seconds")
    parser.add_argument(
        "--keep-console",
        action="store_true",
        help="at the end, keep the web console (and the beats and worker) up until Ctrl-C",
    )
    parser.add_argument(
        "--dev-data-dir",
        type=Path,
        default=EXAMPLES / ".celery_sched-dev",
        help="the dev server's folder, when the services do not answer",
    )
    args = parser.parse_args()
    if args.jobs < 0 or args.soon < 1:
        parser.error("--jobs must be >= 0 and --soon >= 1")
    with services(args.dev_data_dir):
        run(args.jobs, args.soon, keep_console=args.keep_console)


def run(job_count: int, soon_count: int, *, keep_console: bool = False) -> None:
    # Settings come from app.conf (or CELERY_SCHED_* environment variables).
    app.conf.celery_sched_db_schema = SCHEMA
    app.conf.celery_sched_key_prefix = SCHEMA
    drop_schema()

    with Client(app) as client:
        client.migrate()

        start = dt.datetime.now(dt.UTC)
        began = time.perf_counter()
        written = client.schedule_many(reminders(start, job_count))
        elapsed = time.perf_counter() - began
        print(f"scheduled {written:,} jobs in {elapsed:.2f}s ({written / elapsed:,.0f} jobs/s)")

        # One job at a time; the arguments mirror Celery's send_task.
        job = client.schedule(
            send_reminder.name,
            args=(job_count, "one more"),
            countdown=600,
            key="reminder:extra",
            queue="celery",
        )
        print(f"scheduled {job.key} due {job.due_at:%Y-%m-%d %H:%M:%S} UTC, status {job.status}")
        cancelled = client.cancel(job.key)
        stored = client.get(job.key)
        print(f"cancel({job.key!r}) -> {cancelled}; status now {stored.status if stored else None}")

        print("\njobs per status:")
        for status, count in sorted(client.counts_by_status().items()):
            print(f"  {status:<10} {count:>8,}")

        print("\njobs per hour (UTC):")
        for hour, count in sorted(client.counts_by_hour().items()):
            print(f"  {hour:%Y-%m-%d %H:00}  {count:>6,}")

        run_beats_and_worker(client, soon_count, keep_console=keep_console)


def start(name: str, *args: str) -> subprocess.Popen[bytes]:
    """Start ``celery -A proj ARGS`` with this example's settings."""
    env = {
        **os.environ,
        "PYTHONPATH": str(EXAMPLES),
        "CELERY_SCHED_DB_SCHEMA": SCHEMA,
        "CELERY_SCHED_KEY_PREFIX": SCHEMA,
    }
    log = (EXAMPLES / f".{name}.log").open("wb")
    celery = str(Path(sys.executable).with_name("celery"))
    print(f"  started {name}: celery -A proj {' '.join(args)}  (log: examples/.{name}.log)")
    return subprocess.Popen(
        [celery, "-A", "proj", *args], cwd=EXAMPLES, env=env, stdout=log, stderr=log
    )


def read_console(path: str, timeout: float = 30.0) -> dict[str, Any]:
    """A page of the example's web console as JSON (``?format=json``),
    waiting up to ``timeout`` for the console to answer."""
    url = f"http://127.0.0.1:{WEB_PORT}{path}?format=json"
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                page: dict[str, Any] = json.load(reply)
                return page
        except OSError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"the web console at {url} did not answer ({exc}); see examples/.web.log"
                ) from exc
            time.sleep(0.5)


def show_console() -> None:
    """What the web console says about the run: the same numbers, over HTTP."""
    overview = read_console("/")
    schedules = read_console("/schedules")["schedules"]
    leaders = [row for row in overview["leaders"] if row["holder"]]
    sent = sum(count for _, count, _ in overview["per_minute"])
    print(
        f"\nthe web console at http://127.0.0.1:{WEB_PORT}/ answers: "
        f"{overview['total']:,} jobs, {len(leaders)} shard leader(s), "
        f"{sent:,} dispatched in the last hour, {len(schedules)} schedules"
    )


def run_beats_and_worker(client: Client, soon_count: int, *, keep_console: bool = False) -> None:
    print(f"\nstarting two beats and a worker, then scheduling {soon_count:,} jobs:")
    procs = [
        start("worker", "worker", "--pool=threads", "--concurrency=8", "--loglevel=INFO"),
        start("beat-1", "beat", "-S", "celery_sched", "--loglevel=INFO", "-s", "/dev/null"),
        start("beat-2", "beat", "-S", "celery_sched", "--loglevel=INFO", "-s", "/dev/null"),
    ]
    console = importlib.util.find_spec("starlette") is not None
    if console:
        # The web console over the same schema, for as long as the example runs.
        procs.append(start("web", "sched", "web", "--bind", f"127.0.0.1:{WEB_PORT}"))
        print(f"  web console: http://127.0.0.1:{WEB_PORT}/")
    try:
        start_at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
        client.schedule_many(
            {
                "task": send_reminder.name,
                "args": (user_id, "your order has shipped"),
                "eta": start_at + dt.timedelta(seconds=SOON_SPREAD * i / soon_count),
                "key": f"shipped:{user_id}",
            }
            for i, user_id in enumerate(range(soon_count))
        )
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            time.sleep(2)
            counts = client.counts_by_status()
            shown = ", ".join(f"{status} {n:,}" for status, n in sorted(counts.items()))
            print(f"  {shown}")
            if counts.get(JobStatus.SUCCEEDED, 0) >= soon_count:
                print(f"every one of the {soon_count:,} jobs ran; the rest wait for tomorrow.")
                break
        else:
            raise SystemExit("the jobs did not all run within 3 minutes; see examples/.*.log")
        show_periodic(client)
        if console:
            show_console()
            if keep_console:
                print("the console, beats and worker stay up; Ctrl-C stops them.")
                with contextlib.suppress(KeyboardInterrupt):
                    signal.pause()
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        print("stopped the beats and the worker.")


def print_schedules(client: Client) -> None:
    for info in client.schedules.list():
        next_run = f"{info.next_run_at:%H:%M:%S}" if info.next_run_at else "-"
        if info.next_run_at and info.next_run_at.date() != dt.datetime.now(dt.UTC).date():
            next_run = f"{info.next_run_at:%Y-%m-%d %H:%M:%S}"
        last_run = f"{info.last_run_at:%H:%M:%S} {info.last_status}" if info.last_run_at else "-"
        print(
            f"  {info.name:<34} {info.kind:<9} next {next_run:<19} last {last_run:<20} {info.state}"
        )


def show_periodic(client: Client) -> None:
    """The periodic schedules the leader synced from the code, and runtime changes."""
    print("\nperiodic schedules (from beat_schedule and @app.task(schedule=...)), in UTC:")
    print_schedules(client)

    # Runtime management: no restart; a change takes effect within one tick.
    client.schedules.add(
        "example.every-3s", send_reminder.name, 3, args=(0, "periodic hello"), misfire="skip"
    )
    job = client.schedules.trigger("cleanup")
    print("\nadded 'example.every-3s' at runtime;", end=" ")
    print(f"triggered 'cleanup' now: job {job.key if job else None}")
    time.sleep(10)
    client.schedules.pause("example.every-3s")
    print("10 s later (then 'example.every-3s' was paused):")
    print_schedules(client)


if __name__ == "__main__":
    main()
