"""A real Django project configures celery_sched (issue 15, point 2).

``tests/django_project`` follows Django's Celery docs: ``CELERY_*`` names in
``tests/django_project/settings.py``, read through
``config_from_object("django.conf:settings", namespace="CELERY")``. It runs
in a subprocess so that ``django.setup()`` leaves no global state behind in
this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _run_report() -> tuple[dict[str, Any], str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("CELERY_SCHED_", "DJANGO_"))
    }
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-m", "tests.django_project.report"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_settings_are_read_from_django_settings() -> None:
    report, _stderr = _run_report()
    assert report["values"] == {
        "database_url": "postgresql+psycopg://django:hunter2@db.example:5432/django_jobs",
        "redis_url": "redis://:hunter3@cache.example:6379/5",
        "db_schema": "django_jobs",
        "batch_size": 77,
        "lease_ttl": 10.0,  # misspelled in tests/django_project/settings.py
    }
    assert report["origins"] == {
        "database_url": "app config CELERY_SCHED_DATABASE_URL",
        "redis_url": "app config CELERY_SCHED_REDIS_URL",
        "db_schema": "app config CELERY_SCHED_DB_SCHEMA",
        "batch_size": "app config CELERY_SCHED_BATCH_SIZE",
        "lease_ttl": "default",
    }


def test_a_misspelled_django_setting_warns() -> None:
    _report, stderr = _run_report()
    assert "'CELERY_SCHED_LEASE_TL'" in stderr
    assert "did you mean 'CELERY_SCHED_LEASE_TTL'" in stderr


def test_the_beat_banner_names_the_django_settings() -> None:
    report, _stderr = _run_report()
    banner = report["banner"]
    assert "db.example:5432/django_jobs (schema django_jobs; from app config " in banner
    assert "CELERY_SCHED_DATABASE_URL)" in banner
    assert "from app config CELERY_SCHED_REDIS_URL" in banner
    assert "hunter" not in banner
