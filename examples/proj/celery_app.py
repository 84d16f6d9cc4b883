"""The Celery app: stock Celery configuration plus celery_sched's job tracking.

celery_sched reads its own settings from ``app.conf.celery_sched_*`` or, as
here, from the ``CELERY_SCHED_*`` environment variables (the defaults point at
PostgreSQL and Redis on 127.0.0.1). Celery itself takes the broker from
``CELERY_BROKER_URL`` when that is set.

The periodic schedule below is stock beat configuration: ``celery beat -S
celery_sched`` reads it (and the decorator-declared tasks in
``proj/periodic.py``) and runs every occurrence once, from any number of beats.
"""

from __future__ import annotations

import datetime as dt

from celery import Celery
from celery.schedules import crontab, solar

from celery_sched import tracking
from celery_sched.schedules import clocked

app = Celery("proj", include=["proj.tasks", "proj.periodic"])

app.conf.update(
    broker_url="amqp://guest:guest@127.0.0.1:5672//",
    timezone="UTC",
    task_serializer="json",
    accept_content=["json"],
    # Jobs carry their own ids; nothing in the example reads task results.
    task_ignore_result=True,
    # Acknowledge after the task ran, so a worker crash redelivers the
    # message instead of dropping it.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
)

app.conf.beat_schedule = {
    "cleanup": {"task": "proj.periodic.cleanup", "schedule": dt.timedelta(seconds=10)},
    "nightly-report": {
        "task": "proj.periodic.report",
        "schedule": crontab(hour="2", minute="30"),
        "args": ("nightly",),
        # celery_sched extras: the crontab's own timezone (02:30 London time,
        # once per night also across DST changes), and what to do after downtime.
        "timezone": "Europe/London",
        "misfire": "once",
    },
    "sunrise-lights": {
        "task": "proj.periodic.lights",
        "schedule": solar("sunrise", 51.5074, -0.1278),
        "args": ("on",),
    },
    "launch": {
        "task": "proj.periodic.launch",
        "schedule": clocked(dt.datetime(2030, 1, 1, 9, 0, tzinfo=dt.UTC)),
    },
}

# Workers report each job's progress (running, succeeded, failed) to the job
# store, so the reconciler does not requeue jobs a worker has already taken.
tracking.install(app)
