"""The project's Celery app, written as Django's Celery docs write the celery module."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_project.settings")

app = Celery("django_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
