"""The repository's own furniture: compose file, README, scripts, example app.

Whether Docker Compose itself accepts the compose file needs its CLI:
``tests/integration/test_compose.py``.
"""

from __future__ import annotations

import ast
import io
import os
import re
import runpy
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CELERY_SERVICES = ("migrate", "worker", "beat", "flower", "console")


def _compose() -> dict[str, Any]:
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_compose_has_every_service() -> None:
    services = _compose()["services"]
    assert set(services) == {
        "postgres",
        "redis",
        "rabbitmq",
        "prometheus",
        "grafana",
        *CELERY_SERVICES,
    }
    assert services["postgres"]["image"] == "postgres:15"
    assert services["redis"]["image"] == "redis:7"
    assert services["rabbitmq"]["image"] == "rabbitmq:3-management"
    for name in ("postgres", "redis", "rabbitmq"):
        assert services[name]["healthcheck"]["test"], name


def test_compose_runs_two_beats_after_migration() -> None:
    services = _compose()["services"]
    beat = services["beat"]
    assert beat["deploy"]["replicas"] == 2
    assert beat["command"][:6] == ["celery", "-A", "proj", "beat", "-S", "celery_sched"]
    assert services["migrate"]["command"] == ["celery", "-A", "proj", "sched", "migrate"]
    assert services["migrate"]["restart"] == "no"
    for name in ("worker", "beat", "console"):
        needs = services[name]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully", name
        for backing in ("postgres", "redis", "rabbitmq"):
            assert needs[backing]["condition"] == "service_healthy", (name, backing)


def test_compose_beats_and_workers_serve_metrics_that_prometheus_scrapes() -> None:
    services = _compose()["services"]
    beat_port = services["beat"]["environment"]["CELERY_SCHED_METRICS_PORT"]
    worker_port = services["worker"]["environment"]["CELERY_SCHED_WORKER_METRICS_PORT"]
    check = services["beat"]["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"], check
    assert "/healthz" in check[3] and "CELERY_SCHED_METRICS_PORT" in check[3], check
    volumes = services["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in volumes
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    scraped = {
        (sd["names"][0], str(sd["port"]))
        for job in config["scrape_configs"]
        for sd in job["dns_sd_configs"]
    }
    # Every replica by its service name (compose's DNS answers with all of them).
    assert scraped == {("beat", beat_port), ("worker", worker_port)}


def test_compose_console_asks_for_credentials_and_stays_on_the_hosts_loopback() -> None:
    console = _compose()["services"]["console"]
    assert console["command"][:5] == ["celery", "-A", "proj", "sched", "web"]
    # Bound beyond loopback inside its container, so auth is configured ...
    assert "--insecure" not in console["command"]
    assert console["environment"]["CELERY_SCHED_WEB_AUTH"].startswith("${CELERY_SCHED_WEB_AUTH")
    # ... and published to the host's loopback only.
    assert console["ports"] == ["127.0.0.1:8808:8808"]


def test_compose_configures_every_celery_service() -> None:
    services = _compose()["services"]
    for name in CELERY_SERVICES:
        env = services[name]["environment"]
        assert env["CELERY_SCHED_DATABASE_URL"].startswith("postgresql+psycopg://"), name
        assert env["CELERY_SCHED_REDIS_URL"].startswith("redis://redis:"), name
        assert env["CELERY_BROKER_URL"].startswith("amqp://"), name


def test_readme_opens_with_the_two_setup_commands() -> None:
    lines = _readme().splitlines()
    assert lines[0] == "# celery_sched"
    first_section = next(i for i, line in enumerate(lines) if line.startswith("## "))
    intro = "\n".join(lines[:first_section])
    assert "\n./scripts/example.sh " in intro
    assert "\n./scripts/test.sh " in intro


def test_readme_configuration_table_matches_settings() -> None:
    script = runpy.run_path(str(ROOT / "scripts" / "settings_table.py"))
    table = script["render_table"]()
    assert table in _readme(), "re-run scripts/settings_table.py and paste it into README.md"


def test_readme_names_every_exception() -> None:
    tree = ast.parse((ROOT / "celery_sched" / "errors.py").read_text())
    classes = [node.name for node in tree.body if isinstance(node, ast.ClassDef)]
    assert "CelerySchedError" in classes
    readme = _readme()
    missing = [name for name in classes if f"`{name}`" not in readme]
    assert not missing, f"README's error reference lacks {missing}"


def test_scripts_are_executable_bash() -> None:
    for path in [ROOT / ".ci" / "run", *sorted((ROOT / "scripts").glob("*.sh"))]:
        assert os.access(path, os.X_OK), f"{path} is not executable"
        assert path.read_text().startswith("#!/usr/bin/env bash\n"), path


def test_example_project_is_found_by_celery() -> None:
    # A subprocess, so importing `proj` cannot leak into other tests.
    code = (
        "from celery.app.utils import find_app\n"
        "app = find_app('proj')\n"
        "app.loader.import_default_modules()\n"
        "print(app.main, sorted(name for name in app.tasks if name.startswith('proj.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "examples",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    expected = [
        "proj.periodic.cleanup",
        "proj.periodic.heartbeat",
        "proj.periodic.launch",
        "proj.periodic.lights",
        "proj.periodic.refresh_dashboard",
        "proj.periodic.report",
        "proj.tasks.send_reminder",
    ]
    assert out.strip() == f"proj {expected}"


#: A file a comment cites: a path with a known extension, or one under a top-level folder.
_CITED_PATH = re.compile(
    r"(?<![\w./:-])("
    r"(?:[\w.-]+/)*[\w-]+\.(?:py|md|sh|sql|lua|yml|yaml|toml|json|ini|cfg|mako)"
    r"|(?:celery_sched|tests|benchmarks|scripts|examples)/[\w./-]*"
    r")(?!\w)"
)


def _comments_and_docstrings(source: str) -> Iterator[tuple[int, str]]:
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                yield node.body[0].lineno, docstring


def test_comments_in_tests_and_benchmarks_cite_files_that_exist() -> None:
    """A path in a comment or docstring names a file or folder of the
    repository (from its root, or from the citing file's folder)."""
    missing = []
    for path in sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for line, text in _comments_and_docstrings(path.read_text()):
            for match in _CITED_PATH.finditer(text):
                cited = match.group(1).rstrip(".,;:")
                if not any((base / cited).exists() for base in (ROOT, path.parent)):
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {cited}")
    assert not missing, missing
