"""scripts/example.sh on a machine whose services do not answer: the dev-server path.

The configured PostgreSQL, Redis and broker URLs point at closed ports, as on a
fresh machine with only Python; the example must start the dev server
(``celery_sched[dev]``), run every job through two beats and a worker with the
dev server's Redis as the broker, and stop the dev server at the end. A smaller
run (``--jobs``/``--soon``) keeps it within a minute.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from celery_sched import dev as devserver

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SOON = 200


def closed_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_example_runs_on_the_dev_server_when_no_service_answers(tmp_path: Path) -> None:
    port = closed_port()
    data_dir = tmp_path / "dev"
    env = {
        **os.environ,
        "CELERY_SCHED_DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:{port}/none",
        "CELERY_SCHED_REDIS_URL": f"redis://127.0.0.1:{port}/0",
        "CELERY_BROKER_URL": f"amqp://guest:guest@127.0.0.1:{port}//",
    }
    try:
        result = subprocess.run(
            [
                "bash",
                "scripts/example.sh",
                "--jobs",
                "2000",
                "--soon",
                str(SOON),
                "--dev-data-dir",
                str(data_dir),
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    finally:
        devserver.stop(data_dir)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert f"PostgreSQL at postgresql+psycopg://postgres@127.0.0.1:{port}/none" in output
    assert "starting the dev server" in output
    assert "scheduled 2,000 jobs" in output
    assert f"every one of the {SOON:,} jobs ran" in output
    assert "stopped the beats and the worker." in output
    assert "stopped the dev server." in output
    # The dev server's own cluster held the jobs, and nothing of it still runs.
    assert (data_dir / "postgres" / "PG_VERSION").is_file()
    assert devserver.running(data_dir) is None
