"""``python -m tests.django_project.report``: set Django up, then print as JSON
what celery_sched read from the project's settings and the beat banner."""

from __future__ import annotations

import json

import django

from celery_sched.beat import Scheduler
from celery_sched.settings import Settings
from tests.django_project.celery_app import app  # sets DJANGO_SETTINGS_MODULE

NAMES = ("database_url", "redis_url", "db_schema", "batch_size", "lease_ttl")

if __name__ == "__main__":
    django.setup()
    settings = Settings.from_app(app)
    report = {
        "values": {name: getattr(settings, name) for name in NAMES},
        "origins": {name: settings.origin(name) for name in NAMES},
        "banner": Scheduler(app, lazy=True).info,
    }
    print(json.dumps(report))
