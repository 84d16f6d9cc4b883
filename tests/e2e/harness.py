"""Real beat, worker and Flower processes for end-to-end and fault tests.

A :class:`Cluster` owns one test's schema, Redis prefix and queue; every
process it starts is a subprocess of the real ``celery`` command running
``tests.e2e.app`` (or the project named by ``app``), with its output in a log
file that is printed when the test fails. :class:`RedisServer` and
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
from collections.abc import Callable, Iterator
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


class Cluster:
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
        self.tmp_path = tmp_path
        self.app = app
        self.settings = settings
        self.broker_url = broker_url
        self.queue = queue
        self.dsn = settings.libpq_conninfo()
        self.schema = settings.db_schema
        self.procs: list[Proc] = []
        self.env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "E2E_BROKER_URL": broker_url,
            "E2E_QUEUE": queue,
            "E2E_PG_DSN": self.dsn,
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
            **(extra_env or {}),
        }
        with self.connect() as conn:
            conn.execute(
                f'CREATE TABLE IF NOT EXISTS "{self.schema}".e2e_runs '
                "(task_id text, job_key text, tag text, due double precision, "
                "ran double precision, worker text)"
            )

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

    def start_beat(self, name: str = "beat", **env: str) -> Proc:
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

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.signal(signal.SIGCONT)
                proc.stop()

    def dump_logs(self) -> str:
        parts = []
        for proc in self.procs:
            tail = proc.output()[-6000:]
            parts.append(f"===== {proc.name} (pid {proc.pid}, rc {proc.popen.poll()})\n{tail}")
        return "\n".join(parts)

    # -- database -----------------------------------------------------------

    def connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.dsn, autocommit=True)

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(sql.replace("{s}", f'"{self.schema}"'), params).fetchall()

    def runs(self) -> list[tuple[str, str, float, float]]:
        """(task_id, job_key, due, ran) of every recorded execution."""
        rows = self.query("SELECT task_id, job_key, due, ran FROM {s}.e2e_runs")
        return [(str(a), str(b), float(c), float(d)) for a, b, c, d in rows]

    def run_count(self) -> int:
        return int(self.query("SELECT count(*) FROM {s}.e2e_runs")[0][0])

    def leader(self) -> tuple[int, str] | None:
        rows = self.query("SELECT epoch, holder FROM {s}.leaders WHERE shard = 0")
        return (int(rows[0][0]), str(rows[0][1])) if rows else None

    def leader_proc(self) -> Proc | None:
        current = self.leader()
        if current is None:
            return None
        pid = int(current[1].rsplit(":", 1)[-1])
        return next((p for p in self.procs if p.pid == pid), None)


def wait_for(
    condition: Callable[[], Any], *, timeout: float, interval: float = 0.2, what: str = ""
) -> Any:
    """Poll ``condition`` until it returns something truthy, or fail."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(interval)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def iter_lags(runs: list[tuple[str, str, float, float]]) -> Iterator[float]:
    for _task_id, _key, due, ran in runs:
        yield ran - due


# -- services of a run's own ------------------------------------------------------


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private ``redis-server`` on a loopback port of its own, without
    persistence, so that :meth:`restart` brings it back empty."""

    def __init__(self, name: str, log_dir: Path, port: int | None = None) -> None:
        self.name = name
        self.log_dir = log_dir
        self.port = port or free_port()
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
                "127.0.0.1",
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
