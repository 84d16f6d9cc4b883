"""``docker compose config`` accepts docker-compose.yml.

Not a unit test: it runs the Docker Compose CLI (the v2 plugin or the
standalone ``docker-compose``; no engine needed), which scripts/bootstrap.sh
installs when it may. The file's contents are checked in
``tests/unit/test_repo_layout.py``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"


def _compose_command() -> list[str]:
    """``docker compose`` (the v2 plugin) or the standalone ``docker-compose``."""
    plugin = subprocess.run(["docker", "compose", "version"], capture_output=True, check=False)
    if plugin.returncode == 0:
        return ["docker", "compose"]
    standalone = shutil.which("docker-compose")
    assert standalone, (
        "neither 'docker compose' nor 'docker-compose' is installed: scripts/bootstrap.sh "
        "installs Debian's docker-compose when run as root"
    )
    return [standalone]


def test_compose_file_is_valid_for_docker_compose(tmp_path: Path) -> None:
    """``docker compose config`` accepts the file and reads back the services
    the unit tests check; a broken copy is refused."""
    command = _compose_command()
    checked = subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), "config"],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    assert checked.returncode == 0, checked.stderr
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    assert set(yaml.safe_load(checked.stdout)["services"]) == set(services)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("replicas: 2", "replicas: two", 1))
    refused = subprocess.run(
        [*command, "-f", str(broken), "config"], capture_output=True, check=False, cwd=ROOT
    )
    assert refused.returncode != 0
