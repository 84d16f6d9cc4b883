"""The chaos soak: real beats and workers, a job stream, seeded faults, then the checker.

``python -m tests.soak.runner --minutes N [--seed S] [--mode M ...]`` (or
``scripts/soak.sh``); a mode is comma-joined dimensions (``tests/soak/spec.py``:
tracked/untracked workers, mixed/plain/task tasks, ``shards<N>``, ``dense``,
``clients``), ``--mode`` may be repeated and ``--mode all`` runs each mode:

1. creates a database of its own (``soak_<random>``) on the PostgreSQL server
   of ``CELERY_SCHED_TEST_DATABASE_URL`` and starts two private
   ``redis-server`` instances on free loopback ports: one for the staging set
   and the leader lease, one as the Celery broker;
2. starts 3 ``celery beat -S celery_sched`` and 2 prefork ``celery worker``
   processes of ``tests.soak.app`` (the harness of ``tests/e2e``);
3. for N minutes schedules a stream of one-off jobs (plain tasks,
   ``celery_sched.Task`` tasks, and Task tasks with an effect inside
   ``ledger_transaction``, as the mode says) beside the app's periodic
   schedules, with the mode's extra load (``tests/soak/load.py``), and
   injects a seeded random fault every 10-20 s (see ``tests/soak/faults.py``;
   a leader fault waits for a burst of ``--burst`` jobs due together to be
   claimed, so it lands between a claim and its publish); a process that
   exits is started again, as a supervisor would;
4. settles (until every job finished and its task recorded a start, or
   ``--settle`` seconds), stops the
   processes and runs the invariant checker (``tests/soak/checker.py``).

Progress goes to stdout; each mode ends with one JSON line (its ``mode``,
figures and violations); several modes run one after the other, each in a
process of its own, and a summary JSON object is the last line. Exits 1 on
any violation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import random
import shutil
import subprocess
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
from tests.soak.checker import FaultWindow, Manifest, check
from tests.soak.faults import EXTRA_KINDS, KINDS, Extras, Faults, Roster
from tests.soak.load import ClientLoad, dense_rows
from tests.soak.spec import TABLES, Mode, parse_modes

PG_URL = os.environ.get(
    "CELERY_SCHED_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
QUEUE = "soak"
LEASE_TTL = 3.0
VISIBILITY_TIMEOUT = 25.0
WORKER_TIMEOUT = 20.0
#: Partitions the ``dense`` mode lays jobs over, and the fewest it accepts in
#: the table.
DENSE_RANGES = 160
DENSE_MIN_PARTITIONS = 150
#: Faults aimed at the leader's dispatch: each comes as a burst of ``--burst``
#: jobs is claimed and published (between a claim and its publish is where a
#: killed or paused leader can leave rows claimed but never sent).
AIMED = ("leader_kill", "leader_stop")


def progress(message: str, *args: Any) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] " + (message % args if args else message), flush=True)


@dataclasses.dataclass
class Stream:
    """Schedules one-off jobs at ``rate`` per second until ``stop_at``."""

    client: Any
    rng: random.Random
    rate: float
    stop_at: float
    tasks: tuple[str, ...]
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
            task = self.rng.choice(self.tasks)
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


def _unfinished(cluster: Cluster, stream_end: float, last_due: float) -> int:
    # Jobs due after the soak (dense, clients) stay pending: not counted.
    rows = cluster.query(
        "SELECT count(*) FROM {s}.jobs WHERE status IN "
        "('pending', 'dispatched', 'running', 'retrying') "
        "AND due_at <= to_timestamp(%s) "
        "AND (schedule_id IS NULL OR due_at <= to_timestamp(%s))",
        last_due + 1,
        stream_end,
    )
    return int(rows[0][0])


def _load(client: Client, rows: list[dict[str, Any]], what: str) -> str:
    """``schedule_many(rows)`` through faults; the last error if it gave up."""
    error = ""
    for _attempt in range(10):
        try:
            client.schedule_many(rows)
            return ""
        except CelerySchedError as exc:
            error = f"{type(exc).__name__}: {exc}"
            progress("%s: bulk load failed, again: %s", what, error[:200])
            # All or nothing: a commit whose answer was lost is there.
            with contextlib.suppress(CelerySchedError):
                if client.get(rows[0]["key"]) is not None:
                    return ""
            time.sleep(1.0)
    return error or "gave up"


def _load_dense(
    client: Client, rng: random.Random, mode: Mode
) -> tuple[dict[str, str], dict[str, str], list[dict[str, Any]]]:
    """Schedule the dense layout in bulk loads: (jobs due now, jobs due
    after the soak, keys the client gave up on)."""
    now = dt.datetime.now(dt.UTC)
    rows = dense_rows(now, rng, mode.one_off_tasks, ranges=DENSE_RANGES)
    due: dict[str, str] = {}
    future: dict[str, str] = {}
    failures: list[dict[str, Any]] = []
    started = time.monotonic()
    for start in range(0, len(rows), 80):
        chunk = rows[start : start + 80]
        error = _load(client, chunk, "dense")
        if error:
            failures += [{"key": row["key"], "error": error[:300]} for row in chunk]
            continue
        for row in chunk:
            (due if row["eta"] <= now else future)[row["key"]] = row["task"]
    progress(
        "dense: %d jobs (%d due now) over %d ranges in %.1fs",
        len(rows),
        len(due),
        DENSE_RANGES,
        time.monotonic() - started,
    )
    return due, future, failures


def _burst(
    client: Client, rng: random.Random, tasks: tuple[str, ...], size: int, serial: int
) -> tuple[dict[str, str], float, list[dict[str, Any]]]:
    """``size`` jobs due together 2 s from now: (key -> task, their due
    time, keys the client gave up on)."""
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    rows = [
        {
            "task": rng.choice(tasks),
            "args": (0.0,),
            "eta": due,
            "key": f"burst-{serial:03d}-{n:05d}",
            "max_attempts": 50,
        }
        for n in range(size)
    ]
    error = _load(client, rows, "burst")
    if error:
        return {}, due.timestamp(), [{"key": r["key"], "error": error[:300]} for r in rows]
    return {str(row["key"]): str(row["task"]) for row in rows}, due.timestamp(), []


def _wait_for_claim(cluster: Cluster, keys: list[str], deadline: float) -> int:
    """Return as soon as a leader has claimed some of ``keys`` (its publish
    follows, and the claims of the rest), or at ``deadline``: how many."""
    with contextlib.suppress(psycopg.Error), cluster.connect() as conn:
        query = (
            f'SELECT count(*) FROM "{cluster.schema}".jobs '
            "WHERE key = ANY(%s) AND status <> 'pending'"
        )
        while time.time() < deadline:
            row = conn.execute(query, (keys,)).fetchone()
            if row is not None and row[0]:
                return int(row[0])
            time.sleep(0.002)
    return 0


def _missing_runs(cluster: Cluster, keys: list[str]) -> int:
    """How many of ``keys`` have no row or no start recorded by their task:
    untracked rows end ``sent`` whether or not a worker got the message (a
    killed worker's unacknowledged ones come back a broker visibility
    timeout later)."""
    rows = cluster.query(
        "SELECT %s - count(*) FROM {s}.jobs j WHERE j.key = ANY(%s) "
        "AND EXISTS (SELECT 1 FROM soak_runs r WHERE r.job_id = j.id::text)",
        len(keys),
        keys,
    )
    return int(rows[0][0])


def soak(
    args: argparse.Namespace,
    mode: Mode,
    tmp: Path,
    database_url: str,
    extras: Extras | None = None,
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
            # A burst (--burst) is dispatched as a few batches, claimed
            # ahead while the one before is published: a leader fault during
            # it may find rows claimed and not yet sent.
            batch_size=500,
            max_attempts=50,
            # The checker counts every periodic occurrence as owed a run: a
            # leader killed or paused leaves a gap of several seconds, which
            # under the default `once` collapses into one late run (the
            # misfire tests check that); `all` runs each missed occurrence.
            misfire_policy="all",
            # No pin: the beats share the shards among themselves.
            shards=mode.shards,
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
            **mode.env(),
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
        progress(
            "mode %s: leader elected; %d beats, %d workers", mode.name, args.beats, args.workers
        )

        # Imported only now: the app reads its broker, queue and mode from
        # the environment set above.
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
            tracked=mode.tracked,
        )
        must_run: dict[str, str] = {}
        future: dict[str, str] = {}
        failures: list[dict[str, Any]] = []
        load: ClientLoad | None = None
        load_client: Client | None = None
        with Client(app, settings=settings) as client:
            if mode.dense:
                must_run, future, failures = _load_dense(client, random.Random(rng.random()), mode)
            stream_start = time.time()
            stream_end = stream_start + args.minutes * 60
            stream = Stream(
                client, random.Random(rng.random()), args.rate, stream_end, mode.one_off_tasks
            )
            thread = threading.Thread(target=stream.run, name="soak-stream", daemon=True)
            thread.start()
            if mode.clients:
                # Clients of their own pool, three threads per connection.
                load_client = Client(app, settings=settings)
                load = ClientLoad(
                    client=load_client,
                    threads=3 * settings.pool_max_size,
                    tasks=mode.one_off_tasks,
                    seed=rng.random(),
                    stop_at=stream_end,
                )
                load.start()
            # Every kind once per round, in a seeded order, so a short soak
            # still sees each of them.
            order: list[str] = []
            windows: list[FaultWindow] = []
            next_fault = stream_start + rng.uniform(args.fault_min, args.fault_max)
            while time.time() < stream_end:
                roster.supervise(time.time() - stream_start)
                if time.time() >= next_fault and next_fault < stream_end - 5:
                    if not order:
                        order = list(KINDS + (EXTRA_KINDS if extras else ()))
                        rng.shuffle(order)
                    kind = order.pop(0)
                    if kind in AIMED and args.burst:
                        jobs, due, gave_up = _burst(
                            client, rng, mode.one_off_tasks, args.burst, len(windows)
                        )
                        must_run.update(jobs)
                        failures += gave_up
                        claimed = _wait_for_claim(cluster, list(jobs), due + 3.0)
                    window = faults.inject(kind)
                    if kind in AIMED and args.burst:
                        # Whether it landed in the dispatch: part of the
                        # burst claimed when it was found, part after it.
                        window = dataclasses.replace(
                            window, detail=f"{window.detail}; burst {claimed}/{len(jobs)} claimed"
                        )
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
            if load is not None and load_client is not None:
                if load.join(60):
                    load_client.close()
                else:
                    # A client stuck in a call holds the pool: closing it
                    # would wait for it too.
                    progress("clients: %d thread(s) never returned", len(load.problems))
                progress(
                    "clients: %d must run, %d cancelled, %d due after the soak; calls %s",
                    len(load.jobs),
                    len(load.cancelled),
                    len(load.future),
                    dict(load.ops),
                )
                must_run.update(load.jobs)
                future.update(load.future)
        must_run.update(stream.jobs)
        last_due = max(stream_end + 4.0, load.last_due if load is not None else 0.0)

        settle_deadline = max(time.time(), last_due) + args.settle
        left = -1
        while time.time() < settle_deadline:
            roster.supervise(time.time() - stream_start)
            try:
                left = _unfinished(cluster, stream_end, last_due)
                if left == 0 and time.time() > last_due:
                    left = _missing_runs(cluster, list(must_run))
                    if left == 0:
                        break
            except psycopg.Error:
                left = -1
            time.sleep(2)
        settled = round(time.time() - stream_end, 1)
        progress("settled after %.1fs (%d unfinished or not run)", settled, left)
        cluster.stop_all()

        report = check(
            dsn,
            Manifest(
                jobs=must_run,
                stream_start=stream_start,
                stream_end=stream_end,
                faults=windows,
                schedule_failures=stream.failures + failures,
                periodic=mode.periodic,
                tracked=mode.tracked,
                cancelled=load.cancelled if load is not None else {},
                future=future,
                client_problems=load.problems if load is not None else [],
                min_partitions=DENSE_MIN_PARTITIONS if mode.dense else 0,
            ),
        )
        return {
            "soak": "celery_sched",
            "mode": mode.name,
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
                "burst": args.burst,
                "shards": settings.shards,
                "pool_max_size": settings.pool_max_size,
            },
            **({"clients": load.figures()} if load is not None else {}),
            "process_exits": roster.exits,
            **report,
        }
    finally:
        if cluster is not None:
            cluster.stop_all()
        staging.stop()
        broker.stop()


def run_one(args: argparse.Namespace, mode: Mode) -> int:
    """One mode in this process: its JSON line last; 0 if it is clean."""
    tmp = Path(tempfile.mkdtemp(prefix="celery_sched_soak_"))
    progress(
        "soak: mode %s, seed %d, %.1f minutes, logs in %s", mode.name, args.seed, args.minutes, tmp
    )
    extras = Extras(tmp) if args.extra_faults else None
    with extras.database() if extras else private_database(PG_URL) as database_url:
        result = soak(args, mode, tmp, database_url, extras)
    clean = not result["violations"] and not result["violation_counts"]
    if clean and not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        progress("logs kept in %s", tmp)
    sys.stdout.flush()
    print(json.dumps(result, default=str), flush=True)
    return 0 if clean else 1


def run_each(args: argparse.Namespace, modes: list[Mode]) -> int:
    """Each mode in a process of its own (the soak's app reads its mode at
    import), their output passed through; a summary JSON line last."""
    summary = []
    for mode in modes:
        command = [sys.executable, "-m", "tests.soak.runner", "--mode", mode.name]
        for name, value in vars(args).items():
            if name == "mode" or value is None or value is False:
                continue
            flag = "--" + name.replace("_", "-")
            command += [flag] if value is True else [flag, str(value)]
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        last = ""
        for line in child.stdout:
            print(line, end="", flush=True)
            if line.strip():
                last = line
        rc = child.wait()
        try:
            result = json.loads(last)
            counts = result.get("violation_counts")
        except (json.JSONDecodeError, AttributeError):
            counts = None
        summary.append(
            {
                "mode": mode.name,
                "rc": rc,
                "clean": rc == 0,
                "violation_counts": counts if counts is not None else {"no_result": 1},
            }
        )
    clean = all(entry["clean"] for entry in summary)
    print(
        json.dumps(
            {"summary": "celery_sched soak", "seed": args.seed, "clean": clean, "modes": summary}
        )
    )
    return 0 if clean else 1


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
    parser.add_argument(
        "--burst", type=int, default=1500, help="jobs due together as a leader fault hits (0: none)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the logs even when clean")
    parser.add_argument(
        "--extra-faults",
        action="store_true",
        help="also fail PostgreSQL over, partition a beat from Redis, jump a beat's clock and "
        "delete the broker queue (needs root, iptables, faketime, PostgreSQL binaries)",
    )
    parser.add_argument(
        "--mode",
        action="append",
        default=None,
        help="comma-joined dimensions, e.g. untracked,shards16,dense (repeatable; 'all': "
        "each mode in turn; default tracked)",
    )
    args = parser.parse_args(argv)
    try:
        modes = parse_modes(args.mode or [])
    except ValueError as exc:
        parser.error(str(exc))
    # celery_sched's own warnings in this process (the client's retries).
    logging.basicConfig(
        level=logging.WARNING, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s"
    )
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    if shutil.which("redis-server") is None:
        print("soak: redis-server is not installed (scripts/bootstrap.sh)", file=sys.stderr)
        return 2
    if len(modes) == 1:
        return run_one(args, modes[0])
    return run_each(args, modes)


if __name__ == "__main__":
    sys.exit(main())
