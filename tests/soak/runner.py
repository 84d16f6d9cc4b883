"""The chaos soak: real beats and workers, a job stream, seeded faults, then the checker.

``python -m tests.soak.runner --minutes N [--seed S]`` (or ``scripts/soak.sh``):

1. creates a database of its own (``soak_<random>``) on the PostgreSQL server
   of ``CELERY_SCHED_TEST_DATABASE_URL`` and starts two private
   ``redis-server`` instances on free loopback ports: one for the staging set
   and the leader lease, one as the Celery broker;
2. starts 3 ``celery beat -S celery_sched`` and 2 prefork ``celery worker``
   processes of ``tests.soak.app`` (the harness of ``tests/e2e``);
3. for N minutes schedules a stream of one-off jobs (plain tasks,
   ``celery_sched.Task`` tasks, and Task tasks with an effect inside
   ``ledger_transaction``) beside the app's periodic schedules, and injects a
   seeded random fault every 10-20 s (see ``tests/soak/faults.py``); a
   process that exits is started again, as a supervisor would;
4. settles (until every job finished, or ``--settle`` seconds), stops the
   processes and runs the invariant checker (``tests/soak/checker.py``).

Progress goes to stdout; the last line is one JSON object (figures and
violations). Exits 1 on any violation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from celery_sched.backends import build_store
from celery_sched.client import Client
from celery_sched.errors import CelerySchedError
from celery_sched.settings import Settings
from tests.e2e.harness import Cluster, RedisServer, private_database, wait_for, with_database
from tests.soak.checker import Manifest, check
from tests.soak.faults import EXTRA_KINDS, KINDS, Extras, Faults, Roster
from tests.soak.spec import ONE_OFF_TASKS, TABLES

PG_URL = os.environ.get(
    "CELERY_SCHED_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
QUEUE = "soak"
LEASE_TTL = 3.0
VISIBILITY_TIMEOUT = 25.0
WORKER_TIMEOUT = 20.0


def progress(message: str, *args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] " + (message % args if args else message), flush=True)


@dataclasses.dataclass
class Stream:
    """Schedules one-off jobs at ``rate`` per second until ``stop_at``."""

    client: Any
    rng: random.Random
    rate: float
    stop_at: float
    jobs: dict[str, str] = dataclasses.field(default_factory=dict)
    failures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    retried: int = 0

    def run(self) -> None:
        index = 0
        next_at = time.time()
        while next_at < self.stop_at:
            time.sleep(max(0.0, next_at - time.time()))
            next_at += 1 / self.rate
            index += 1
            key = f"soak-{index:06d}"
            task = self.rng.choice(ONE_OFF_TASKS)
            hold = round(self.rng.uniform(0.0, 0.6), 3)
            countdown = self.rng.uniform(0.0, 4.0)
            error = ""
            # The client retries transient errors itself; past that (a fault
            # lasting longer), the stream tries again with the same key, which
            # is safe: a commit that did happen is returned, not duplicated.
            for _attempt in range(20):
                try:
                    self.client.schedule(
                        task,
                        args=(hold,),
                        countdown=countdown,
                        key=key,
                        max_attempts=50,
                        if_exists="return",
                    )
                except CelerySchedError as exc:
                    error = f"{type(exc).__name__}: {exc}"
                    self.retried += 1
                    time.sleep(0.5)
                    continue
                self.jobs[key] = task
                break
            else:
                self.failures.append({"key": key, "error": error[:300]})


def _unfinished(cluster: Cluster, stream_end: float) -> int:
    rows = cluster.query(
        "SELECT count(*) FROM {s}.jobs WHERE status IN "
        "('pending', 'dispatched', 'running', 'retrying') "
        "AND (schedule_id IS NULL OR due_at <= to_timestamp(%s))",
        stream_end,
    )
    return int(rows[0][0])


def soak(
    args: argparse.Namespace, tmp: Path, database_url: str, extras: Extras | None = None
) -> dict[str, Any]:
    binds = extras.staging_binds(args.beats) if extras else ("127.0.0.1",)
    staging = RedisServer("redis-staging", tmp, binds=binds)
    broker = RedisServer("redis-broker", tmp)
    staging.start()
    broker.start()
    cluster: Cluster | None = None
    try:
        settings = Settings(
            database_url=database_url,
            redis_url=staging.url,
            key_prefix="soak",
            lease_ttl=LEASE_TTL,
            lease_safety_margin=0.5,
            visibility_timeout=VISIBILITY_TIMEOUT,
            sweep_interval=1.0,
            reconcile_interval=2.0,
            staging_window=20.0,
            batch_size=500,
            max_attempts=50,
            # The checker counts every periodic occurrence as owed a run: a
            # leader killed or paused leaves a gap of several seconds, which
            # under the default `once` collapses into one late run (the
            # misfire tests check that); `all` runs each missed occurrence.
            misfire_policy="all",
        )
        store = build_store(settings)
        store.migrate()
        store.close()
        dsn = settings.libpq_conninfo()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for statement in TABLES:
                conn.execute(statement)

        env = {
            "CELERY_SCHED_MAX_ATTEMPTS": "50",
            "CELERY_SCHED_LEDGER_LEASE": "10",
            # The worker heartbeat timeout of the leader's rescuer; an older
            # celery_sched ignores the unknown variable.
            "CELERY_SCHED_WORKER_TIMEOUT": str(WORKER_TIMEOUT),
        }
        os.environ.update(
            {"E2E_BROKER_URL": broker.url, "E2E_QUEUE": QUEUE, "E2E_PG_DSN": dsn, **env}
        )
        cluster = Cluster(
            tmp_path=tmp,
            settings=settings,
            broker_url=broker.url,
            queue=QUEUE,
            extra_env=env,
            app="tests.soak.app",
        )
        roster = Roster(cluster)
        for n in range(1, args.beats + 1):
            env = extras.beat_env(n, staging) if extras else {}
            roster.add(f"beat{n}", "beat", cluster.start_beat(f"beat{n}", **env))
        for n in range(1, args.workers + 1):
            roster.add(
                f"worker{n}",
                "worker",
                cluster.start_worker(f"worker{n}", concurrency=args.concurrency, pool="prefork"),
            )
        wait_for(cluster.leader, timeout=60, what="a leader")
        progress("leader elected; %d beats, %d workers", args.beats, args.workers)

        # Imported only now: the app reads its broker and queue from the
        # environment set above.
        from tests.soak.app import app

        rng = random.Random(args.seed)
        faults = Faults(
            cluster=cluster,
            roster=roster,
            staging=staging,
            broker=broker,
            admin_dsn=with_database(dsn, "postgres"),
            database=settings.sqlalchemy_url().database or "",
            rng=random.Random(rng.random()),
            extras=extras,
        )
        stream_start = time.time()
        stream_end = stream_start + args.minutes * 60
        with Client(app, settings=settings) as client:
            stream = Stream(client, random.Random(rng.random()), args.rate, stream_end)
            thread = threading.Thread(target=stream.run, name="soak-stream", daemon=True)
            thread.start()
            # Every kind once per round, in a seeded order, so a short soak
            # still sees each of them.
            order: list[str] = []
            windows = []
            next_fault = stream_start + rng.uniform(args.fault_min, args.fault_max)
            while time.time() < stream_end:
                roster.supervise(time.time() - stream_start)
                if time.time() >= next_fault and next_fault < stream_end - 5:
                    if not order:
                        order = list(KINDS + (EXTRA_KINDS if extras else ()))
                        rng.shuffle(order)
                    kind = order.pop(0)
                    window = faults.inject(kind)
                    windows.append(window)
                    progress("fault %s: %s (%.1fs)", kind, window.detail, window.end - window.start)
                    next_fault = window.end + rng.uniform(args.fault_min, args.fault_max)
                time.sleep(0.5)
            thread.join(60)
            progress(
                "stream stopped: %d jobs scheduled, %d schedule retries",
                len(stream.jobs),
                stream.retried,
            )

        settle_deadline = time.time() + args.settle
        left = -1
        while time.time() < settle_deadline:
            roster.supervise(time.time() - stream_start)
            try:
                left = _unfinished(cluster, stream_end)
            except psycopg.Error:
                left = -1
            if left == 0 and len(stream.jobs) == _count_keys(cluster, list(stream.jobs)):
                break
            time.sleep(2)
        settled = round(time.time() - stream_end, 1)
        progress("settled after %.1fs (%d unfinished)", settled, left)
        cluster.stop_all()

        report = check(
            dsn,
            Manifest(
                jobs=stream.jobs,
                stream_start=stream_start,
                stream_end=stream_end,
                faults=windows,
                schedule_failures=stream.failures,
            ),
        )
        return {
            "soak": "celery_sched",
            "seed": args.seed,
            "minutes": args.minutes,
            "settle_s": settled,
            "settings": {
                "lease_ttl": LEASE_TTL,
                "visibility_timeout": VISIBILITY_TIMEOUT,
                "worker_timeout": WORKER_TIMEOUT,
                "beats": args.beats,
                "workers": args.workers,
                "concurrency": args.concurrency,
                "rate": args.rate,
            },
            "process_exits": roster.exits,
            **report,
        }
    finally:
        if cluster is not None:
            cluster.stop_all()
        staging.stop()
        broker.stop()


def _count_keys(cluster: Cluster, keys: list[str]) -> int:
    rows = cluster.query("SELECT count(*) FROM {s}.jobs WHERE key = ANY(%s)", keys)
    return int(rows[0][0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--settle", type=float, default=60.0, help="longest settle, seconds")
    parser.add_argument("--rate", type=float, default=4.0, help="one-off jobs per second")
    parser.add_argument("--beats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--fault-min", type=float, default=10.0)
    parser.add_argument("--fault-max", type=float, default=20.0)
    parser.add_argument("--keep", action="store_true", help="keep the logs even when clean")
    parser.add_argument(
        "--extra-faults",
        action="store_true",
        help="also fail PostgreSQL over, partition a beat from Redis, jump a beat's clock and "
        "delete the broker queue (needs root, iptables, faketime, PostgreSQL binaries)",
    )
    args = parser.parse_args(argv)
    # celery_sched's own warnings in this process (the client's retries).
    logging.basicConfig(
        level=logging.WARNING, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if shutil.which("redis-server") is None:
        print("soak: redis-server is not installed (scripts/bootstrap.sh)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="celery_sched_soak_"))
    progress("soak: seed %d, %.1f minutes, logs in %s", args.seed, args.minutes, tmp)
    extras = Extras(tmp) if args.extra_faults else None
    with extras.database() if extras else private_database(PG_URL) as database_url:
        result = soak(args, tmp, database_url, extras)
    clean = not result["violations"] and not result["violation_counts"]
    if clean and not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        progress("logs kept in %s", tmp)
    sys.stdout.flush()
    print(json.dumps(result, default=str), flush=True)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
