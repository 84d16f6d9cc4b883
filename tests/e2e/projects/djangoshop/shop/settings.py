"""Django settings of the shop project. Celery's settings are the ``CELERY_*`` ones."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from parcels.schedules import OnTheGrid
from parcels.values import Parcel

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "django-insecure-shop-e2e")
DEBUG = False
ALLOWED_HOSTS: list[str] = []

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "parcels",
]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("SHOP_SQLITE", BASE_DIR / "db.sqlite3"),
    }
}

LANGUAGE_CODE = "en-gb"
TIME_ZONE = "Europe/Paris"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Where the parcels app writes what it did (one JSON line per event).
SHOP_RUN_LOG = os.environ.get("SHOP_RUN_LOG", str(BASE_DIR / "runs.jsonl"))
SHOP_PUBLISH_LOG = os.environ.get("SHOP_PUBLISH_LOG", str(BASE_DIR / "published.jsonl"))
SHOP_QUEUE_PREFIX = os.environ.get("SHOP_QUEUE_PREFIX", "")

# -- Celery ------------------------------------------------------------------------

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = TIME_ZONE
CELERY_TASK_SERIALIZER = "pickle"
CELERY_ACCEPT_CONTENT = ["pickle", "json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = SHOP_QUEUE_PREFIX + "default"
CELERY_TASK_ROUTES = ["parcels.routing.route_by_priority"]
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
CELERY_BEAT_MAX_LOOP_INTERVAL = 1

# celery_sched, when beat runs with -S celery_sched (stock beat ignores them).
CELERY_SCHED_DATABASE_URL = os.environ.get("CELERY_SCHED_DATABASE_URL")
CELERY_SCHED_REDIS_URL = os.environ.get("CELERY_SCHED_REDIS_URL")

CELERY_BEAT_SCHEDULE = {
    "priority-collection": {
        "task": "parcels.tasks.collect",
        "schedule": dt.timedelta(seconds=2),
        "args": (
            Parcel(
                ref="PR-7",
                priority=True,
                booked_at=dt.datetime(2030, 12, 31, 23, 30, tzinfo=dt.UTC),
                sizes={"S", "XL"},
            ),
        ),
    },
    "economy-collection": {
        "task": "parcels.tasks.collect",
        "schedule": 3.0,
        "kwargs": {
            "parcel": Parcel(
                ref="EC-3",
                priority=False,
                booked_at=dt.datetime(2030, 1, 2, 3, 4, 5, 6, tzinfo=dt.UTC),
                sizes={"M"},
            )
        },
    },
    "stock-count": {
        "task": "parcels.tasks.count_stock",
        # Every 4 s on the clock's 4-second marks, not 4 s after beat started.
        "schedule": OnTheGrid(dt.timedelta(seconds=4)),
        "args": ({"aisle-1", "aisle-2"}, dt.date(2030, 6, 1)),
    },
}
