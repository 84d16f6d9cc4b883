"""The image's Python environment, built the way Dockerfile builds it, runs the example.

No Docker engine runs here, so the test plays Dockerfile itself: it copies
the build context that .dockerignore leaves (docker-py's own matcher), then
follows the instructions in order: ENV, WORKDIR and COPY into a folder that
stands for the image's root, and the RUN pip line, parsed from the file so it
cannot drift, in a fresh venv of the base image's Python version. From the
final WORKDIR it runs docker-compose.yml's own ``migrate`` and ``beat``
commands against the real services (a schema of the test's own) and the
beat's compose healthcheck, which must fail before the beat serves /healthz
and pass once it leads.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from docker.utils.build import exclude_paths

from tests.e2e.harness import ROOT, Proc, free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: RUN commands the test knows not to matter for Python (the unprivileged user).
NOT_PYTHON = ("useradd ",)
#: A Redis database of the broker for this test alone: the example's
#: periodic tasks are published to its default queue, which no worker here reads.
BROKER_DB = 15


def dockerignore_patterns(root: Path = ROOT) -> list[str]:
    lines = (root / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def build_context(root: Path = ROOT) -> set[str]:
    """The paths (files and folders, relative, ``/``-separated) that ``docker
    build`` sends, by docker-py's implementation of the .dockerignore rules."""
    return set(exclude_paths(str(root), dockerignore_patterns(root)))


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of each instruction, continuation lines joined."""
    found: list[tuple[str, str]] = []
    pending = ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        found.append((keyword.upper(), rest.strip()))
    return found


class Image:
    """The Python side of Dockerfile replayed under ``root``: ``root/<path>``
    stands for ``/<path>`` in the image, ``venv`` for its interpreter."""

    def __init__(self, root: Path, venv: Path) -> None:
        self.root = root
        self.venv = venv
        self.env: dict[str, str] = {}
        self.workdir = root
        self.pip_commands: list[list[str]] = []

    def path(self, image_path: str) -> Path:
        return self.root / image_path.lstrip("/")

    def build(self, dockerfile: Path, context: Path) -> None:
        for keyword, args in instructions(dockerfile):
            if keyword == "FROM":
                self._make_venv(args)
            elif keyword == "ENV":
                for pair in shlex.split(args):
                    name, _, value = pair.partition("=")
                    self.env[name] = value
            elif keyword == "WORKDIR":
                self.workdir = self.path(args) if args.startswith("/") else self.workdir / args
                self.workdir.mkdir(parents=True, exist_ok=True)
            elif keyword == "COPY":
                self._copy(shlex.split(args), context)
            elif keyword == "RUN":
                self._run(args)
            else:
                assert keyword in {"USER", "CMD"}, f"the test does not replay {keyword}"

    def _make_venv(self, image: str) -> None:
        match = re.fullmatch(r"python:(\d+\.\d+)[\w.-]*", image)
        assert match, f"the test expects a python:X.Y base image, not {image}"
        version = match.group(1)
        python = shutil.which(f"python{version}")
        if python is None and f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
            python = sys.executable
        assert python, f"python{version} (the image's Python) is not installed"
        subprocess.run([python, "-m", "venv", str(self.venv)], check=True, timeout=120)

    def _copy(self, args: list[str], context: Path) -> None:
        *sources, dest = args
        target = self.workdir / dest
        for source in sources:
            src = context / source
            assert src.exists(), f"COPY {source}: not in the build context"
            if src.is_dir():
                shutil.copytree(src, target if len(sources) == 1 else target / src.name)
            else:
                into = target if dest.endswith("/") or len(sources) > 1 else target.parent
                into.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, into / src.name if into == target else target)

    def _run(self, command: str) -> None:
        words = shlex.split(command)
        if words[:2] == ["pip", "install"]:
            pip = [str(self.venv / "bin" / "python"), "-m", "pip", *words[1:]]
            self.pip_commands.append(words)
            done = subprocess.run(
                pip,
                cwd=self.workdir,
                env=self.process_env(),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stdout + done.stderr
            return
        assert command.startswith(NOT_PYTHON), f"the test does not replay RUN {command}"

    def process_env(self, **extra: str) -> dict[str, str]:
        """The host's environment without this checkout's venv, the image's
        ENV, the venv first on PATH, then ``extra``."""
        env = {
            name: value
            for name, value in os.environ.items()
            if name not in {"PYTHONPATH", "VIRTUAL_ENV"} and not name.startswith("CELERY")
        }
        env.update(self.env)
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    def start(self, name: str, words: list[str], env: dict[str, str], log: Path) -> Proc:
        """Start a compose command from the image's WORKDIR (``celery -A proj``
        imports ``proj`` from there), output to ``log``."""
        with log.open("wb") as handle:
            popen = subprocess.Popen(
                self.command(words),
                cwd=self.workdir,
                env=env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return Proc(name, popen, log, self.command(words))

    def command(self, words: list[str]) -> list[str]:
        """A compose command (``celery ...``, ``python ...``) with the venv's binary."""
        binary = self.venv / "bin" / words[0]
        assert binary.exists(), f"{words[0]} is not in the image's venv"
        return [str(binary), *words[1:]]


def files_under(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


@pytest.fixture
def broker_url(redis_url: str) -> Iterator[str]:
    url = redis_url.rsplit("/", 1)[0] + f"/{BROKER_DB}"
    yield url
    with redis.Redis.from_url(url) as client:
        client.flushdb()


@pytest.fixture
def image(tmp_path: Path) -> Image:
    """Dockerfile replayed: the context copied as .dockerignore leaves it,
    then built into ``tmp_path/image`` and ``tmp_path/venv``."""
    context = tmp_path / "context"
    for relative in sorted(build_context()):
        source, target = ROOT / relative, context / relative
        if source.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    built = Image(tmp_path / "image", tmp_path / "venv")
    built.build(ROOT / "Dockerfile", context)
    return built


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text: str = reply.read().decode()
    return text


def authorized(url: str, auth: tuple[str, str] | None) -> urllib.request.Request:
    request = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(":".join(auth).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    return request


def web_status(url: str, auth: tuple[str, str] | None) -> int | None:
    """The console's HTTP status for ``url`` (``None``: nothing answers yet)."""
    try:
        with urllib.request.urlopen(authorized(url, auth), timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def healthcheck(image: Image, test: list[str], env: dict[str, str]) -> int:
    assert test[0] == "CMD", test
    return subprocess.run(
        image.command(test[1:]),
        cwd=image.workdir,
        env=env,
        capture_output=True,
        timeout=30,
    ).returncode


def test_the_image_environment_imports_the_example_and_runs_a_leading_beat(
    image: Image, pg_url: str, redis_url: str, pg_schema: str, broker_url: str, tmp_path: Path
) -> None:
    assert len(image.pip_commands) == 1, image.pip_commands
    assert image.workdir == image.path("/app/examples")
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    beat_service = services["beat"]
    port = free_port()
    env = image.process_env(
        CELERY_SCHED_DATABASE_URL=pg_url,
        CELERY_SCHED_REDIS_URL=redis_url,
        CELERY_SCHED_DB_SCHEMA=pg_schema,
        CELERY_SCHED_KEY_PREFIX=pg_schema,
        CELERY_BROKER_URL=broker_url,
        CELERY_SCHED_METRICS_PORT=str(port),
    )
    # The test sets every variable compose gives the beat.
    assert set(beat_service["environment"]) <= set(env), beat_service["environment"]
    before = files_under(image.root)

    migrate = subprocess.run(
        image.command(services["migrate"]["command"]),
        cwd=image.workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert migrate.returncode == 0, migrate.stdout + migrate.stderr

    check = beat_service["healthcheck"]["test"]
    assert healthcheck(image, check, env) != 0, "healthy before any beat serves /healthz"

    beat = image.start("beat", beat_service["command"], env, tmp_path / "beat.log")
    try:
        wait_for(
            lambda: healthcheck(image, check, env) == 0,
            timeout=60,
            interval=0.5,
            what=f"the compose healthcheck to pass\n{beat.tail()}",
        )
        wait_for(
            lambda: re.search(r'^celery_sched_leader\{shard="0"\} 1\.0$', metrics(port), re.M),
            timeout=30,
            what=f"the beat to lead\n{beat.tail()}",
        )
    finally:
        beat.stop()
    assert beat.popen.returncode is not None

    # Every entry of the example's beat_schedule was read, the solar one too.
    import psycopg

    with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as conn:
        kinds: dict[str, Any] = dict(
            conn.execute(f'SELECT name, kind FROM "{pg_schema}".schedules').fetchall()
        )
    assert kinds["sunrise-lights"] == "solar", kinds
    assert {"cleanup", "nightly-report", "launch", "proj.periodic.heartbeat"} <= set(kinds)

    # The console service: the image has the web extra, and the compose
    # command (its port swapped for a free one) serves the schedules to
    # the credentials compose gives it, and to no one else.
    console_service = services["console"]
    words = list(console_service["command"])
    host = words[words.index("--bind") + 1].rsplit(":", 1)[0]
    web_port = free_port()
    words[words.index("--bind") + 1] = f"{host}:{web_port}"
    console_env = {**env, "CELERY_SCHED_WEB_AUTH": "ops:s3cret"}
    console = image.start("console", words, console_env, tmp_path / "console.log")
    try:
        url = f"http://127.0.0.1:{web_port}/schedules?format=json"
        wait_for(
            lambda: web_status(url, None) == 401,
            timeout=60,
            interval=0.5,
            what=f"the console to answer\n{console.tail()}",
        )
        assert web_status(url, ("ops", "wrong")) == 401
        with urllib.request.urlopen(authorized(url, ("ops", "s3cret")), timeout=5) as reply:
            names = {entry["name"] for entry in json.load(reply)["schedules"]}
        assert "sunrise-lights" in names, names
    finally:
        console.stop()
    # An unprivileged user runs the image: nothing may be written under /app.
    assert files_under(image.root) == before
