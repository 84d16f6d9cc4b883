"""A private PostgreSQL primary and streaming replica, for failover tests and the soak.

:func:`pg_pair` starts a primary (``initdb`` and ``pg_ctl`` of
``CELERY_SCHED_TEST_PG_BIN``, default ``/usr/lib/postgresql/15/bin``, else
the newest installed) on a free loopback port in a directory of its own
under ``/tmp``, and a hot standby made with ``pg_basebackup -R`` on another port, replicating
synchronously (the primary's commits wait for the standby's flush) or
asynchronously. :meth:`PgPair.failover` stops the primary with ``-m
immediate`` and promotes the standby (``pg_ctl promote``);
:meth:`PgPair.rebuild_standby` makes the old primary a standby of the new one
again, on its old port, so the same multi-host URL
(:meth:`PgPair.database_url`, ``target_session_attrs=read-write``) keeps
finding whichever node is primary.

The server refuses to run as root: as root, every command runs as the
``postgres`` user (``runuser``), which owns the directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from tests.e2e.harness import free_port, wait_for


def _pg_bin() -> Path:
    """``CELERY_SCHED_TEST_PG_BIN``, else version 15's, else the newest installed."""
    if "CELERY_SCHED_TEST_PG_BIN" in os.environ:
        return Path(os.environ["CELERY_SCHED_TEST_PG_BIN"])
    default = Path("/usr/lib/postgresql/15/bin")
    installed = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3])
    )
    return default if default.exists() or not installed else installed[-1].parent


PG_BIN = _pg_bin()
#: Settings of every node (the standby copies them with the data directory).
CONFIG = """
listen_addresses = '127.0.0.1'
wal_level = replica
max_wal_senders = 8
wal_keep_size = '512MB'
hot_standby = on
max_connections = 300
# The nodes die by `-m immediate`, never with the machine: the OS still
# writes what they wrote, so fsync buys nothing here but time.
fsync = off
synchronous_commit = on
wal_receiver_status_interval = 1
"""


class PgError(RuntimeError):
    """A cluster command failed; the message has its output."""


def _as_postgres() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def _run(*args: str, timeout: float = 120) -> str:
    command = [*_as_postgres(), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise PgError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout


def binaries_missing() -> str | None:
    """Why the cluster cannot be started here, or None."""
    missing = [
        name for name in ("initdb", "pg_ctl", "pg_basebackup") if not (PG_BIN / name).exists()
    ]
    if missing:
        return f"{', '.join(missing)} not found in {PG_BIN} (set CELERY_SCHED_TEST_PG_BIN)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root needs runuser to start PostgreSQL as the postgres user"
    return None


class PgNode:
    """One server of the pair: a data directory served on ``port``."""

    def __init__(self, name: str, root: Path, port: int | None = None) -> None:
        self.name = name
        self.root = root
        self.data = root / name
        self.log = root / f"{name}.log"
        self.port = port or free_port()

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres connect_timeout=3"

    def start(self) -> None:
        # Port and socket directory on the command line: a standby's copy of
        # postgresql.conf is the primary's.
        _run(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.data),
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {self.port} -k {self.root}",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(PgError):
                _run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def promote(self) -> None:
        _run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote")

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        return psycopg.connect(
            self.dsn.replace("dbname=postgres", f"dbname={dbname}"), autocommit=True
        )

    def query(self, sql: str, *params: Any, dbname: str = "postgres") -> list[tuple[Any, ...]]:
        with self.connect(dbname) as conn:
            cursor = conn.execute(sql, params)
            return cursor.fetchall() if cursor.description else []

    def in_recovery(self) -> bool:
        return bool(self.query("SELECT pg_is_in_recovery()")[0][0])

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


class PgPair:
    """A primary and its standby; see the module docstring."""

    def __init__(self, root: Path, *, synchronous: bool) -> None:
        self.root = root
        self.synchronous = synchronous
        self.primary = PgNode("node1", root)
        self.standby = PgNode("node2", root)
        #: How many times :meth:`failover` ran.
        self.failovers = 0

    def start(self) -> None:
        _run(
            str(PG_BIN / "initdb"),
            "-D",
            str(self.primary.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
        )
        with (self.primary.data / "postgresql.conf").open("a") as conf:
            conf.write(CONFIG)
        self.primary.start()
        self._make_standby()

    def _make_standby(self) -> None:
        """A fresh standby of :attr:`primary` in :attr:`standby`'s directory."""
        shutil.rmtree(self.standby.data, ignore_errors=True)
        _run(
            str(PG_BIN / "pg_basebackup"),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            "postgres",
            "-D",
            str(self.standby.data),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        )
        # A standby promoted later must not wait for a standby of its own:
        # the base backup copied the primary's settings, this one included.
        with (self.standby.data / "postgresql.auto.conf").open("a") as conf:
            conf.write("synchronous_standby_names = ''\n")
        self.standby.start()
        wait_for(self._streaming, timeout=30, interval=0.1, what="the standby to stream")
        if self.synchronous:
            self.primary.query("ALTER SYSTEM SET synchronous_standby_names = '*'")
            self.primary.query("SELECT pg_reload_conf()")
            wait_for(
                lambda: self._streaming("sync"),
                timeout=30,
                interval=0.1,
                what="the standby to become synchronous",
            )

    def _streaming(self, sync_state: str | None = None) -> bool:
        rows = self.primary.query("SELECT state, sync_state FROM pg_stat_replication")
        return any(
            state == "streaming" and (sync_state is None or sync == sync_state)
            for state, sync in rows
        )

    # -- what clients use -------------------------------------------------------

    def database_url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy multi-host URL reaching whichever node accepts writes."""
        hosts = "&".join(f"host=127.0.0.1:{node.port}" for node in (self.primary, self.standby))
        return (
            f"postgresql+psycopg://postgres@/{dbname}?{hosts}"
            "&target_session_attrs=read-write&connect_timeout=2"
        )

    # -- faults ---------------------------------------------------------------

    def replay_lsn(self) -> str:
        return str(self.standby.query("SELECT pg_last_wal_replay_lsn()")[0][0])

    def wait_replayed(self, timeout: float = 30) -> None:
        """Wait until the standby has replayed everything the primary wrote
        before this call."""
        target = self.primary.query("SELECT pg_current_wal_lsn()")[0][0]
        wait_for(
            lambda: self.standby.query(
                "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", str(target)
            )[0][0],
            timeout=timeout,
            interval=0.05,
            what="the standby to replay the primary's WAL",
        )

    def detach_standby(self) -> None:
        """Stop the standby's WAL receiver (it stays a readable standby):
        from now on the primary's commits reach it no more. Only for
        asynchronous replication; a synchronous primary would stop committing."""
        assert not self.synchronous, "a synchronous primary would wait for its standby forever"
        self.standby.query("ALTER SYSTEM SET primary_conninfo = ''")
        self.standby.query("SELECT pg_reload_conf()")
        wait_for(
            lambda: not self.standby.query("SELECT count(*) FROM pg_stat_wal_receiver")[0][0],
            timeout=20,
            interval=0.05,
            what="the WAL receiver to stop",
        )

    def failover(self) -> None:
        """Kill the primary (``-m immediate``: no checkpoint, connections cut)
        and promote the standby; the two swap roles."""
        self.primary.stop("immediate")
        self.standby.promote()
        wait_for(
            lambda: not self.standby.in_recovery(),
            timeout=30,
            interval=0.1,
            what="the promoted standby to accept writes",
        )
        self.primary, self.standby = self.standby, self.primary
        self.failovers += 1

    def rebuild_standby(self) -> None:
        """Make the node that died a standby of the new primary again (a fresh
        base backup on its old port), synchronous again if the pair is."""
        self.standby.stop("immediate")
        self._make_standby()

    def close(self) -> None:
        for node in (self.primary, self.standby):
            node.stop("immediate")

    def logs(self) -> str:
        return "\n".join(
            f"===== postgres {node.name} (port {node.port})\n{node.tail()}"
            for node in (self.primary, self.standby)
        )


@contextlib.contextmanager
def pg_pair(*, synchronous: bool) -> Iterator[PgPair]:
    """A started :class:`PgPair`; both servers are stopped and their
    directory removed afterwards (kept, with its logs, when the body raised)."""
    problem = binaries_missing()
    if problem is not None:
        raise PgError(problem)
    # Not pytest's tmp_path: its parents are private to root, and the server
    # runs as postgres.
    root = Path(tempfile.mkdtemp(prefix="celery_sched_pg_"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    pair = PgPair(root, synchronous=synchronous)
    failed = True
    try:
        pair.start()
        yield pair
        failed = False
    finally:
        pair.close()
        if not failed:
            shutil.rmtree(root, ignore_errors=True)
