"""Real beat, worker and Flower processes, shared by the end-to-end and fault
tests, the chaos soak and the benchmarks.

A :class:`ProcessGroup` runs subprocesses with one :class:`Settings` (its
schema and Redis key prefix) and queries that schema; its output goes to a
log file per process, printed when a test fails. :class:`Cluster` is the
tests' group: real ``celery`` commands running ``tests.e2e.app`` (or the
project named by ``app``) on a queue of its own. The benchmarks' runs
(``benchmarks/_common.py``) are groups too. :func:`unique_name`,
:func:`drop_schema` and :func:`delete_keys` give a test or a run its private
schema and key prefix and remove them afterwards; :class:`RedisServer` and
:func:`private_database` give a run services of its own (the chaos soak
restarts and terminates them), so faults touch nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import redis

from celery_sched.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


@dataclasses.dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    #: The command line and the extra environment, to start it again.
    args: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def kill_group(self, sig: int | None = None) -> None:
        """Signal (default SIGKILL) the process and everything it started (a
        prefork pool's children too): each process runs in a session of its own."""
        sig = signal.SIGKILL if sig is None else sig
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            if sig == signal.SIGKILL:
                self.popen.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            # The group, so that no pool child outlives its parent.
            self.kill_group()
            self.popen.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the output."""
        return self.output()[-chars:]


def spawn(name: str, args: list[str], *, log_dir: Path, env: dict[str, str]) -> Proc:
    """Start ``args`` in a session of its own, output to ``log_dir/<name>.log``."""
    log = log_dir / f"{name}.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Proc(name, popen, log, list(args))


# -- a schema and key prefix of one's own -------------------------------------------


def unique_name(prefix: str = "t") -> str:
    """``<prefix>_<12 hex digits>``: a schema, Redis key prefix and queue stem
    nobody else uses."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def drop_schema(database_url: str, schema: str) -> None:
    """``DROP SCHEMA ... CASCADE`` (``database_url`` in SQLAlchemy or libpq form)."""
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def delete_keys(client: Any, prefix: str) -> int:
    """Delete every key whose name starts with ``prefix`` or ``{prefix`` (a
    shard's hash-tagged keys; SCAN, never FLUSHALL: other tests and runs share
    the server); returns how many there were. ``client`` may be a Cluster
    client (its SCAN visits every master, its DEL splits by slot)."""
    keys = [
        key
        for pattern in (prefix + "*", "{" + prefix + "*")
        for key in client.scan_iter(match=pattern, count=1000)
    ]
    for start in range(0, len(keys), 1000):
        client.delete(*keys[start : start + 1000])
    return len(keys)


def settings_env(settings: Settings) -> dict[str, str]:
    """The ``CELERY_SCHED_*`` variables that give a subprocess ``settings``
    (the fields tests and benchmarks change; the others keep their defaults)."""
    return {
        "CELERY_SCHED_DATABASE_URL": settings.database_url,
        "CELERY_SCHED_REDIS_URL": settings.redis_url,
        "CELERY_SCHED_DB_SCHEMA": settings.db_schema,
        "CELERY_SCHED_KEY_PREFIX": settings.key_prefix,
        "CELERY_SCHED_LEASE_TTL": str(settings.lease_ttl),
        "CELERY_SCHED_VISIBILITY_TIMEOUT": str(settings.visibility_timeout),
        "CELERY_SCHED_SWEEP_INTERVAL": str(settings.sweep_interval),
        "CELERY_SCHED_RECONCILE_INTERVAL": str(settings.reconcile_interval),
        "CELERY_SCHED_STAGING_WINDOW": str(settings.staging_window),
        "CELERY_SCHED_BATCH_SIZE": str(settings.batch_size),
        "CELERY_SCHED_SHARDS": str(settings.shards),
        "CELERY_SCHED_MISFIRE_POLICY": settings.misfire_policy,
        "CELERY_SCHED_MISFIRE_GRACE": str(settings.misfire_grace),
    }


# -- processes sharing one schema ----------------------------------------------------


class ProcessGroup:
    """Subprocesses run with one :class:`Settings`, and queries of its schema.

    ``env`` is added to the environment of every process, after the
    ``CELERY_SCHED_*`` variables of ``settings``.
    """

    def __init__(self, *, tmp_path: Path, settings: Settings, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.settings = settings
        self.dsn = settings.libpq_conninfo()
        self.schema = settings.db_schema
        self.procs: list[Proc] = []
        self.env = {**os.environ, **settings_env(settings), **env}

    # -- processes ----------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = spawn(name, args, log_dir=self.tmp_path, env={**self.env, **(env or {})})
        proc.env = dict(env or {})
        self.procs.append(proc)
        return proc

    def respawn(self, proc: Proc, name: str) -> Proc:
        """Start ``proc``'s command again as ``name`` (its own log), as a
        supervisor would after it died."""
        return self._spawn(name, proc.args, proc.env)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.signal(signal.SIGCONT)
                proc.stop()

    def dump_logs(self) -> str:
        parts = []
        for proc in self.procs:
            parts.append(
                f"===== {proc.name} (pid {proc.pid}, rc {proc.popen.poll()})\n{proc.tail(6000)}"
            )
        return "\n".join(parts)

    # -- database -----------------------------------------------------------

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """Rows of ``sql``, in which ``{s}`` names the schema."""
        with self.connect() as conn:
            return conn.execute(sql.replace("{s}", f'"{self.schema}"'), params).fetchall()

    def execute(self, sql: str, *params: Any) -> None:
        with self.connect() as conn:
            conn.execute(sql.replace("{s}", f'"{self.schema}"'), params)

    def stale_claims(self) -> int:
        """Jobs claimed by an older epoch of shard 0 after its current epoch
        was taken: what the fence must keep at 0."""
        epoch, _holder = self.leader() or (0, "")
        acquired_at = self.query("SELECT acquired_at FROM {s}.leaders WHERE shard = 0")[0][0]
        rows = self.query(
            "SELECT count(*) FROM {s}.jobs WHERE leader_epoch < %s AND dispatched_at > %s",
            epoch,
            acquired_at,
        )
        return int(rows[0][0])

    def leader(self) -> tuple[int, str] | None:
        """(epoch, holder) of shard 0's lease; None before a beat has migrated or led."""
        try:
            rows = self.query("SELECT epoch, holder FROM {s}.leaders WHERE shard = 0")
        except psycopg.errors.UndefinedTable:
            return None
        return (int(rows[0][0]), str(rows[0][1])) if rows else None

    def leader_proc(self) -> Proc | None:
        current = self.leader()
        if current is None:
            return None
        pid = int(current[1].rsplit(":", 1)[-1])
        return next((p for p in self.procs if p.pid == pid), None)


class Cluster(ProcessGroup):
    """Processes, schema and helpers for one end-to-end test."""

    def __init__(
        self,
        *,
        tmp_path: Path,
        settings: Settings,
        broker_url: str,
        queue: str,
        extra_env: dict[str, str] | None = None,
        app: str = "tests.e2e.app",
    ) -> None:
        self.app = app
        self.broker_url = broker_url
        self.queue = queue
        super().__init__(
            tmp_path=tmp_path,
            settings=settings,
            env={
                "PYTHONPATH": str(ROOT),
                "E2E_BROKER_URL": broker_url,
                "E2E_QUEUE": queue,
                "E2E_PG_DSN": settings.libpq_conninfo(),
                **(extra_env or {}),
            },
        )
        with self.connect() as conn:
            conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{self.schema}".e2e_runs '
                "(task_id text, job_key text, tag text, due double precision, "
                "ran double precision, worker text)"
            )

    # -- processes ----------------------------------------------------------

    def start_beat(self, name: str = "beat", *, args: Sequence[str] = (), **env: str) -> Proc:
        """``celery -A app beat -S celery_sched`` with ``args`` appended."""
        return self._spawn(
            name,
            [
                CELERY,
                "-A",
                self.app,
                "beat",
                "-S",
                "celery_sched",
                "--loglevel=INFO",
                "-s",
                str(self.tmp_path / f"{name}-schedule"),
                *args,
            ],
            env,
        )

    def start_worker(
        self,
        name: str = "worker",
        concurrency: int = 8,
        *,
        embedded_beat: bool = False,
        pool: str = "threads",
        **env: str,
    ) -> Proc:
        beat = ["-B", "--scheduler", "celery_sched", "-s", str(self.tmp_path / "embedded")]
        return self._spawn(
            name,
            [
                CELERY,
                "-A",
                self.app,
                "worker",
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                "-Q",
                self.queue,
                "-n",
                f"{name}.{self.queue}@%h",
                "--without-heartbeat",
                "--without-gossip",
                "--without-mingle",
                "--loglevel=WARNING",
                *(beat if embedded_beat else []),
            ],
            env,
        )

    def start_flower(self, port: int) -> Proc:
        return self._spawn(
            "flower",
            [
                CELERY,
                "-A",
                self.app,
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
            ],
            {"FLOWER_UNAUTHENTICATED_API": "true"},
        )

    # -- what the e2e app recorded ------------------------------------------

    def runs(self) -> list[tuple[str, str, float, float]]:
        """(task_id, job_key, due, ran) of every recorded execution."""
        rows = self.query("SELECT task_id, job_key, due, ran FROM {s}.e2e_runs")
        return [(str(a), str(b), float(c), float(d)) for a, b, c, d in rows]

    def run_count(self) -> int:
        return int(self.query("SELECT count(*) FROM {s}.e2e_runs")[0][0])


def wait_for(
    condition: Callable[[], Any], *, timeout: float, interval: float = 0.2, what: str = ""
) -> Any:
    """Poll ``condition`` until it returns something truthy; raise
    :class:`TimeoutError` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# -- services of a run's own ------------------------------------------------------


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private ``redis-server`` on a loopback port of its own, without
    persistence, so that :meth:`restart` brings it back empty."""

    def __init__(
        self,
        name: str,
        log_dir: Path,
        port: int | None = None,
        binds: Sequence[str] = ("127.0.0.1",),
    ) -> None:
        self.name = name
        self.log_dir = log_dir
        self.port = port or free_port()
        #: The loopback addresses it listens on (a partition fault cuts one
        #: client off by dropping the packets of the address it uses).
        self.binds = tuple(binds)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: Proc | None = None
        self.starts = 0

    def start(self, timeout: float = 20.0) -> None:
        self.starts += 1
        self.proc = spawn(
            f"{self.name}-{self.starts}",
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                *self.binds,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.log_dir),
            ],
            log_dir=self.log_dir,
            env=dict(os.environ),
        )
        wait_for(self.ping, timeout=timeout, interval=0.05, what=f"{self.name} to answer PING")

    def url_at(self, address: str) -> str:
        """Its URL through one of :attr:`binds`."""
        return f"redis://{address}:{self.port}/0"

    def ping(self) -> bool:
        try:
            with redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1) as r:
                return bool(r.ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill_group()

    def restart(self, down_for: float = 0.0) -> None:
        """kill -9, then start again on the same port: every key is gone."""
        self.kill()
        time.sleep(down_for)
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5, socket_connect_timeout=5)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(5)


def with_database(url: str, name: str) -> str:
    """``url`` (SQLAlchemy or libpq form) naming database ``name`` instead."""
    base, _slash, query = url.partition("?")
    return base.rsplit("/", 1)[0] + "/" + name + (f"?{query}" if query else "")


@contextlib.contextmanager
def private_database(server_url: str, prefix: str = "soak") -> Iterator[str]:
    """``CREATE DATABASE <prefix>_<random>`` on the server of ``server_url``
    (a SQLAlchemy or libpq URL); yields its URL in the same form, and drops it
    (with any connection still open) afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = with_database(server_url.replace("+psycopg", ""), "postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield with_database(server_url, name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
