"""The dev server (``python -m celery_sched dev``) as real processes.

PostgreSQL and Redis come from the ``celery_sched[dev]`` wheels, which
scripts/bootstrap.sh installs; without them every test here fails (the error
names the extra), in CI and everywhere else. No system service is used: the
servers listen on free ports in a data folder under the test's tmp_path.
Run as root, the password tests also try from user ``nobody`` (``runuser``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from celery_sched import dev as devserver

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
EXPORT = re.compile(r"^export (.+)$", re.MULTILINE)


def run_dev(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery_sched", "dev", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def exported(output: str) -> dict[str, str]:
    match = EXPORT.search(output)
    assert match, f"no export line in:\n{output}"
    return dict(pair.split("=", 1) for pair in match.group(1).split())


def gone(pid: int) -> bool:
    """True once ``pid`` has exited (an unreaped zombie has exited too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "dev"
    yield path
    devserver.stop(path)  # whatever a failed test left running


def test_detach_migrate_stop_and_restart_reuses_the_data(data_dir: Path, unique_name: str) -> None:
    first = run_dev("--detach", "--print-env", "--data-dir", str(data_dir))
    assert first.returncode == 0, first.stderr
    env = exported(first.stdout)
    # --print-env prints the export line and nothing else.
    assert first.stdout.strip().count("\n") == 0
    assert set(env) == {"CELERY_SCHED_DATABASE_URL", "CELERY_SCHED_REDIS_URL", "CELERY_BROKER_URL"}
    db_url = env["CELERY_SCHED_DATABASE_URL"]
    # The URLs carry the dev server's password: they work as printed.
    assert re.match(r"postgresql\+psycopg://postgres:[\w-]{20,}@127\.0\.0\.1:\d+/postgres$", db_url)
    assert re.match(r"redis://:[\w-]{20,}@127\.0\.0\.1:\d+/0$", env["CELERY_SCHED_REDIS_URL"])
    # The broker is the same Redis, in another database.
    assert (
        env["CELERY_BROKER_URL"].rsplit("/", 1)[0]
        == env["CELERY_SCHED_REDIS_URL"].rsplit("/", 1)[0]
    )
    assert env["CELERY_BROKER_URL"] != env["CELERY_SCHED_REDIS_URL"]

    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    with redis.Redis.from_url(env["CELERY_SCHED_REDIS_URL"]) as client:
        client.set("dev-test", "1")
        assert client.get("dev-test") == b"1"

    migrated = subprocess.run(
        [CELERY, "-A", "tests.integration.cli_app", "sched", "migrate"],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "CELERY_SCHED_DB_SCHEMA": unique_name,
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrated.returncode == 0, migrated.stderr
    assert "up to date" in migrated.stdout

    # A second start in the same folder reuses the running servers.
    again = run_dev("--detach", "--data-dir", str(data_dir))
    assert again.returncode == 0, again.stderr
    assert "already running; reusing it" in again.stdout
    assert exported(again.stdout) == env

    server = devserver.running(data_dir)
    assert server is not None
    stopped = run_dev("--stop", "--data-dir", str(data_dir))
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped the dev server" in stopped.stdout
    assert gone(server.postgres_pid)
    assert gone(server.redis_pid)
    assert devserver.running(data_dir) is None
    assert "no dev server runs" in run_dev("--stop", "--data-dir", str(data_dir)).stdout

    # Started again: the same cluster (the schema is still there), the same ports.
    restarted = run_dev("--detach", "--print-env", "--data-dir", str(data_dir))
    assert restarted.returncode == 0, restarted.stderr
    assert exported(restarted.stdout) == env
    with psycopg.connect(db_url.replace("+psycopg", "")) as conn:
        row = conn.execute(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = %s",
            (unique_name,),
        ).fetchone()
    assert row is not None and row[0] > 0


def test_foreground_stops_both_servers_on_sigterm(data_dir: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery_sched", "dev", "--data-dir", str(data_dir)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C stops"):
                break
        output = "".join(lines)
        assert "(started)" in output, output
        server = devserver.running(data_dir)
        assert server is not None
        with psycopg.connect(exported(output)["CELERY_SCHED_DATABASE_URL"].replace("+psycopg", "")):
            pass
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "stopped the dev server." in rest
    assert gone(server.postgres_pid)
    assert gone(server.redis_pid)


@pytest.mark.parametrize("option", ["--pg-port", "--redis-port"])
def test_a_port_in_use_is_a_one_line_error_and_writes_nothing(data_dir: Path, option: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_dev("--detach", option, str(port), "--data-dir", str(data_dir))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert option in result.stderr
    assert not data_dir.exists()


def test_an_unwritable_data_dir_is_a_one_line_error(tmp_path: Path) -> None:
    # Root may write anywhere chmod allows nothing; a regular file in the path
    # stops everyone.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    result = run_dev("--detach", "--data-dir", str(blocker / "dev"))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert f"the data folder {blocker / 'dev'} is not writable" in result.stderr
    assert blocker.read_text() == "not a folder\n"


def test_a_running_server_on_another_port_is_not_restarted(data_dir: Path) -> None:
    server = devserver.start(data_dir)
    assert server.started
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        other = probe.getsockname()[1]
    result = run_dev("--detach", "--pg-port", str(other), "--data-dir", str(data_dir))
    assert result.returncode == 1
    assert f"already listens on port {server.postgres_port}, not {other}" in result.stderr
    still = devserver.running(data_dir)
    assert still is not None
    assert (still.postgres_pid, still.postgres_port) == (server.postgres_pid, server.postgres_port)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def as_nobody(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run as user nobody (we are root), with ``env`` and no
    password of ours in its environment."""
    runuser = shutil.which("runuser")
    assert runuser, "runuser (util-linux) is missing"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "REDIS"))}
    return subprocess.run(
        [runuser, "-u", "nobody", "--", "env", *(f"{k}={v}" for k, v in env.items()), *argv],
        env={**clean, "PGPASSFILE": "/nonexistent/.pgpass", "HOME": "/nonexistent"},
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )


def psql(host: str, port: int, command: str) -> list[str]:
    return [
        str(devserver.postgres_bin() / "psql"),
        *("-X", "-w", "-h", host, "-p", str(port), "-U", "postgres", "-d", "postgres"),
        *("-c", command),
    ]


def redis_says(port: int, *commands: str) -> list[str]:
    """A bash line that sends ``commands`` to Redis and prints what it answers."""
    wire = "".join(f"{command}\\r\\n" for command in commands)
    return [
        "bash",
        "-c",
        f"exec 3<>/dev/tcp/127.0.0.1/{port}; printf '{wire}' >&3; timeout 2 cat <&3 || true",
    ]


def test_no_connection_without_the_password(data_dir: Path, tmp_path: Path) -> None:
    server = devserver.start(data_dir)
    pg = {"host": devserver.HOST, "port": server.postgres_port, "user": "postgres"}
    for password in (None, "wrong"):
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(
                **pg, dbname="postgres", password=password, passfile=os.devnull, connect_timeout=5
            )
    for password in (None, "wrong"):
        client = redis.Redis(host=devserver.HOST, port=server.redis_port, password=password)
        with client, pytest.raises(redis.RedisError, match=r"(?i)auth|password"):
            client.ping()

    # The socket sits in a folder of this user's only, and asks for it too.
    assert server.socket_dir is not None and mode(server.socket_dir) == 0o700
    socket_pg = {**pg, "host": str(server.socket_dir)}
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(**socket_pg, dbname="postgres", passfile=os.devnull, connect_timeout=5)
    with psycopg.connect(**socket_pg, dbname="postgres", password=server.password) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    # Where the password is kept, only this user reads.
    assert mode(data_dir) == 0o700
    assert mode(data_dir / "password") == 0o600
    assert mode(data_dir / "redis" / "valkey.conf") == 0o600
    with psycopg.connect(server.database_url.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
    with redis.Redis.from_url(server.redis_url) as client:
        assert client.ping()

    # The attack of issue #30: another local user has the superuser run a
    # program as root, which writes into a folder of root's only (becoming
    # that user needs root).
    if os.geteuid() == 0:
        attempt_as_nobody(server, tmp_path)
    # Stopped, the socket's folder goes with the server.
    devserver.stop(data_dir)
    assert not server.socket_dir.exists()


def attempt_as_nobody(server: devserver.DevServer, tmp_path: Path) -> None:
    """User nobody tries the dev server's PostgreSQL (TCP and socket) and
    Redis without the password, then with it."""
    private = tmp_path / "root-only"
    private.mkdir(mode=0o700)
    target = private / "written-by-nobody"
    attack = f"COPY (SELECT 1) TO PROGRAM 'touch {target}'"
    over_tcp = as_nobody(psql(devserver.HOST, server.postgres_port, attack))
    assert over_tcp.returncode != 0 and "password" in over_tcp.stderr, over_tcp
    over_socket = as_nobody(psql(str(server.socket_dir), server.postgres_port, attack))
    assert over_socket.returncode != 0 and "Permission denied" in over_socket.stderr, over_socket
    assert not target.exists()
    said = as_nobody(redis_says(server.redis_port, "PING", "CONFIG SET dir /tmp"))
    assert said.stdout.count("-NOAUTH") == 2 and "PONG" not in said.stdout, said
    # The password is what stops them, not the switch of user: with it, they get in.
    allowed = as_nobody(
        psql(devserver.HOST, server.postgres_port, "SELECT 1"), PGPASSWORD=server.password
    )
    assert allowed.returncode == 0, allowed
    said = as_nobody(redis_says(server.redis_port, f"AUTH {server.password}", "PING"))
    assert "+PONG" in said.stdout, said


def test_a_folder_of_an_earlier_version_gets_a_password(data_dir: Path) -> None:
    """A data folder made before the password: its cluster trusted every
    local connection and no password file existed."""
    first = devserver.start(data_dir)
    (data_dir / "password").unlink()
    # Still running, it cannot be handed out with a password it does not ask for.
    reused = run_dev("--detach", "--data-dir", str(data_dir))
    assert reused.returncode == 1
    assert "without a password" in reused.stderr and "--stop" in reused.stderr, reused.stderr
    assert reused.stderr.strip().count("\n") == 0, reused.stderr
    devserver.stop(data_dir)
    (data_dir / "postgres" / "pg_hba.conf").write_text("host all all 127.0.0.1/32 trust\n")

    server = devserver.start(data_dir)
    assert server.password != first.password
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(
            host=devserver.HOST,
            port=server.postgres_port,
            user="postgres",
            dbname="postgres",
            passfile=os.devnull,
            connect_timeout=5,
        )
    with psycopg.connect(server.database_url.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    with redis.Redis.from_url(server.redis_url) as client:
        assert client.ping()
