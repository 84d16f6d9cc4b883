"""Celery settings in the old upper-case names, as a Celery 3 project wrote them.

Celery 5 still reads these names from a module without a namespace. The
broker and result URLs and the queue prefix come from the deployment's
environment.
"""

from __future__ import annotations

import datetime as dt
import os

from proj.models import Parcel
from proj.schedules import AtSeconds

BROKER_URL = os.environ.get("BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_BACKEND = os.environ.get("RESULT_BACKEND", "redis://127.0.0.1:6379/0")
CELERY_TASK_RESULT_EXPIRES = 120

# Parcels travel as objects: only pickle carries them.
CELERY_TASK_SERIALIZER = "pickle"
CELERY_RESULT_SERIALIZER = "pickle"
CELERY_ACCEPT_CONTENT = ["pickle", "json"]

CELERY_TIMEZONE = "Europe/London"
CELERY_IMPORTS = ("proj.tasks",)
CELERY_ROUTES = ("proj.routing.route_by_urgency",)
CELERY_DEFAULT_QUEUE = os.environ.get("QUEUE_PREFIX", "") + "default"
CELERYD_PREFETCH_MULTIPLIER = 4
CELERYBEAT_MAX_LOOP_INTERVAL = 1

CELERYBEAT_SCHEDULE = {
    "express-pickup": {
        "task": "proj.tasks.pickup",
        "schedule": 2.0,
        "args": (
            Parcel(
                ref="EX-1",
                express=True,
                ready_at=dt.datetime(2031, 5, 6, 7, 8, 9, tzinfo=dt.UTC),
                labels=frozenset({"fragile", "signed"}),
            ),
        ),
    },
    "standard-pickup": {
        "task": "proj.tasks.pickup",
        "schedule": dt.timedelta(seconds=3),
        "kwargs": {
            "parcel": Parcel(
                ref="ST-1",
                express=False,
                ready_at=dt.datetime(2031, 5, 6, 12, 0, tzinfo=dt.UTC),
                labels=frozenset({"bulky"}),
            )
        },
    },
    "urgent-audit": {
        "task": "proj.tasks.audit",
        # A sub-minute "crontab": the 0th, 7th, 15th, ... second of each minute.
        "schedule": AtSeconds((0, 7, 15, 22, 30, 37, 45, 52)),
        "kwargs": {
            "urgent": True,
            "since": dt.datetime(2024, 2, 29, 23, 59, 59, 123456, tzinfo=dt.UTC),
            "depots": {"LHR", "MAN"},
        },
    },
}
