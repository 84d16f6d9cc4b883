"""Django settings: celery_sched is configured with ``CELERY_*`` names, read
through ``config_from_object("django.conf:settings", namespace="CELERY")``."""

from __future__ import annotations

SECRET_KEY = "celery-sched-tests-only"
INSTALLED_APPS: list[str] = []
USE_TZ = True
TIME_ZONE = "UTC"

CELERY_BROKER_URL = "memory://"
CELERY_SCHED_DATABASE_URL = "postgresql+psycopg://django:hunter2@db.example:5432/django_jobs"
CELERY_SCHED_REDIS_URL = "redis://:hunter3@cache.example:6379/5"
CELERY_SCHED_DB_SCHEMA = "django_jobs"
CELERY_SCHED_BATCH_SIZE = 77
# Misspelled on purpose: the test expects a warning naming CELERY_SCHED_LEASE_TTL.
CELERY_SCHED_LEASE_TL = 3
