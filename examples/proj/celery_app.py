"""The Celery app: stock Celery configuration plus celery_sched's job tracking.

celery_sched reads its own settings from ``app.conf.celery_sched_*`` or, as
here, from the ``CELERY_SCHED_*`` environment variables (the defaults point at
PostgreSQL and Redis on 127.0.0.1). Celery itself takes the broker from
``CELERY_BROKER_URL`` when that is set.
"""

from __future__ import annotations

from celery import Celery

from celery_sched import tracking

app = Celery("proj", include=["proj.tasks"])

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

# Workers report each job's progress (running, succeeded, failed) to the job
# store, so the reconciler does not requeue jobs a worker has already taken.
tracking.install(app)
