"""How the PostgreSQL backends connect: the workers' bounded connection pool
(threads and gevent greenlets), and running behind a real PgBouncer in
transaction pooling mode."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from celery_sched.errors import StoreError
from celery_sched.models import ClaimOutcome, JobStatus, WorkerUpdate
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore, PostgresLedger
from tests.contract.conftest import new_job

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
THREADS = 50
BOUND = 4


def worker_connections(settings: Settings) -> int:
    """The sessions the workers' hot-path pool holds open right now."""
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
            (f"celery_sched[{settings.db_schema}] worker",),
        ).fetchone()
    assert row is not None
    return int(row[0])


def claimed_jobs(store: PostgresJobStore, count: int) -> list[uuid.UUID]:
    due = store.now() - dt.timedelta(seconds=5)
    store.load_jobs(new_job(f"job-{i}", due) for i in range(count))
    epoch = store.acquire_epoch(0, "test")
    return [job.id for job in store.claim_due(shard=0, epoch=epoch, limit=count)]


def hot_path_round(
    store: PostgresJobStore, ledger: PostgresLedger, job_id: uuid.UUID, name: str, rounds: int
) -> int:
    """What a worker does around its tasks, ``rounds`` times; the successes."""
    ok = 0
    for n in range(rounds):
        key = f"{name}-{n}"
        claim = ledger.acquire(key, owner=name, lease=30.0)
        ok += claim.outcome == ClaimOutcome.ACQUIRED
        ok += ledger.complete(key, owner=name, result="1")
        store.heartbeat(name, n)
    running = WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker=name)
    ok += store.apply_worker_updates([running]) == 1
    ok += store.apply_worker_updates([WorkerUpdate(job_id=job_id, status=JobStatus.SUCCEEDED)])
    return ok


def test_many_threads_share_a_bounded_set_of_connections(settings: Settings) -> None:
    settings = dataclasses.replace(settings, pool_max_size=BOUND)
    store = PostgresJobStore(settings)
    store.migrate()
    ledger = PostgresLedger(store)
    try:
        ids = claimed_jobs(store, THREADS)
        seen: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.append(worker_connections(settings))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        start = threading.Barrier(THREADS)

        def work(at: int) -> int:
            start.wait()
            return hot_path_round(store, ledger, ids[at], f"t{at}", rounds=10)

        try:
            with ThreadPoolExecutor(THREADS) as pool:
                results = list(pool.map(work, range(THREADS)))
        finally:
            done.set()
            watcher.join()
        assert results == [22] * THREADS
        held = worker_connections(settings)
        assert 1 <= held <= BOUND
        assert max(seen) <= BOUND, seen
        assert store.counts_by_status() == {JobStatus.SUCCEEDED: THREADS}
    finally:
        store.close()
    # The server ends a closed connection's backend a moment after the
    # client hung up: on a loaded machine, give it that moment.
    deadline = time.monotonic() + 10
    while worker_connections(settings) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_connections(settings) == 0


GREENLETS = """
from gevent import monkey

monkey.patch_all()

import json
import os
import sys
import time
import uuid

import gevent
import psycopg

from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore, PostgresLedger
from tests.integration.test_postgres_connections import hot_path_round, worker_connections

settings = Settings(**json.loads(os.environ["TEST_SETTINGS"]))
ids = [uuid.UUID(job_id) for job_id in json.loads(os.environ["TEST_JOBS"])]
store = PostgresJobStore(settings)
ledger = PostgresLedger(store)
seen = []

def watch():
    while True:
        seen.append(worker_connections(settings))
        gevent.sleep(0.005)

watcher = gevent.spawn(watch)
greenlets = [
    gevent.spawn(hot_path_round, store, ledger, job_id, f"g{at}", 10)
    for at, job_id in enumerate(ids)
]
gevent.joinall(greenlets, raise_error=True)
watcher.kill()
held = worker_connections(settings)
store.close()
# As with threads: the server ends a closed connection's backend a moment
# after the client hung up.
deadline = time.monotonic() + 10
while worker_connections(settings) and time.monotonic() < deadline:
    gevent.sleep(0.05)
json.dump(
    {
        "results": [g.value for g in greenlets],
        "seen": seen,
        "held": held,
        "after_close": worker_connections(settings),
    },
    sys.stdout,
)
"""


def test_greenlets_share_a_bounded_set_of_connections(settings: Settings) -> None:
    """A gevent worker pool (monkey-patched threads are greenlets) keeps to
    the same bound as threads do."""
    settings = dataclasses.replace(settings, pool_max_size=BOUND)
    store = PostgresJobStore(settings)
    store.migrate()
    try:
        ids = claimed_jobs(store, THREADS)
        fields = {"database_url": settings.database_url, "db_schema": settings.db_schema}
        env = {
            **os.environ,
            "TEST_SETTINGS": json.dumps({**fields, "pool_max_size": BOUND}),
            "TEST_JOBS": json.dumps([str(job_id) for job_id in ids]),
        }
        proc = subprocess.run(
            [sys.executable, "-c", GREENLETS],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert report["results"] == [22] * THREADS
        assert 1 <= report["held"] <= BOUND
        assert max(report["seen"]) <= BOUND, report["seen"]
        assert report["after_close"] == 0
        assert store.counts_by_status() == {JobStatus.SUCCEEDED: THREADS}
    finally:
        store.close()


# -- behind PgBouncer ------------------------------------------------------------


#: The TimeZone PgBouncer gives its server sessions: celery_sched must not
#: depend on the server's default (it sets UTC in every transaction).
SERVER_ZONE = "America/New_York"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def pgbouncer_url(pg_url: str, tmp_path: Path) -> Iterator[str]:
    """A private PgBouncer in transaction pooling mode in front of the test
    database; the URL of the test database through it."""
    binary = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )
    if binary is None:
        pytest.fail("pgbouncer is not installed; scripts/bootstrap.sh installs it (apt-get)")
    upstream = urllib.parse.urlsplit(pg_url.replace("+psycopg", ""))
    user = upstream.username or "postgres"
    dbname = upstream.path.lstrip("/")
    port = _free_port()
    # Readable by the user PgBouncer drops to when started as root.
    tmp_path.chmod(0o755)
    (tmp_path / "userlist.txt").write_text(f'"{user}" ""\n')
    config = tmp_path / "pgbouncer.ini"
    server = f"host={upstream.hostname or '127.0.0.1'} port={upstream.port or 5432}"
    config.write_text(
        textwrap.dedent(
            f"""\
            [databases]
            {dbname} = {server} dbname={dbname} timezone={SERVER_ZONE}

            [pgbouncer]
            listen_addr = 127.0.0.1
            listen_port = {port}
            unix_socket_dir =
            auth_type = trust
            auth_file = {tmp_path / "userlist.txt"}
            pool_mode = transaction
            default_pool_size = 3
            max_client_conn = 200
            ignore_startup_parameters = extra_float_digits
            """
        )
    )
    for path in (config, tmp_path / "userlist.txt"):
        path.chmod(0o644)
    # PgBouncer refuses to run as root; -u drops to another user.
    command = [binary, *(["-u", "postgres"] if os.getuid() == 0 else []), str(config)]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    output = proc.communicate()[0]
                    pytest.fail(f"pgbouncer did not start: {output}")
                time.sleep(0.05)
        yield f"postgresql+psycopg://{user}@127.0.0.1:{port}/{dbname}"
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def test_store_and_ledger_work_behind_pgbouncer_in_transaction_mode(
    settings: Settings, pgbouncer_url: str
) -> None:
    settings = dataclasses.replace(
        settings, database_url=pgbouncer_url, pgbouncer=True, statement_timeout=0.5
    )
    store = PostgresJobStore(settings)
    ledger = PostgresLedger(store)
    try:
        store.migrate()
        ids = claimed_jobs(store, 8)
        assert len(ids) == 8
        # Threads on both pools, more of them than PgBouncer has server
        # connections, each repeating statements psycopg would otherwise
        # prepare on one server connection and run on another.
        with ThreadPoolExecutor(8) as pool:
            results = list(
                pool.map(
                    lambda at: hot_path_round(store, ledger, ids[at], f"b{at}", rounds=8),
                    range(8),
                )
            )
        assert results == [18] * 8
        assert store.counts_by_status() == {JobStatus.SUCCEEDED: 8}
        entry = ledger.get("b0-0")
        assert entry is not None and entry.result == 1

        # The per-session settings hold inside every transaction, on both paths.
        conninfo = settings.libpq_conninfo()
        with psycopg.connect(conninfo, autocommit=True, prepare_threshold=None) as plain:
            assert plain.execute("SHOW TimeZone").fetchone() == (SERVER_ZONE,)
        db = store.database
        for _ in range(3):
            zone = db.run_raw("zone", lambda cur: cur.execute("SHOW TimeZone").fetchone())
            assert zone == ("UTC",)
            zone = db.transaction("zone", lambda conn: conn.exec_driver_sql("SHOW TimeZone").one())
            assert tuple(zone) == ("UTC",)
        with pytest.raises(StoreError, match="statement timeout"):
            db.run_raw("sleep", lambda cur: cur.execute("SELECT pg_sleep(2)"))
        with pytest.raises(StoreError, match="statement timeout"):
            db.transaction("sleep", lambda conn: conn.exec_driver_sql("SELECT pg_sleep(2)"))
    finally:
        store.close()
