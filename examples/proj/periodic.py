"""The example's periodic tasks: plain Celery tasks, scheduled like any beat project.

Two ways to declare them, both read by ``celery beat -S celery_sched``:

- ``app.conf.beat_schedule`` in ``proj/celery_app.py`` (interval, crontab,
  solar and a clocked one-off there), as stock beat reads it;
- the task decorator, with ``base=celery_sched.Task`` (below): the schedule
  sits next to the code it runs, and the task gets the idempotency ledger.
"""

from __future__ import annotations

import logging

from celery.schedules import crontab

from celery_sched import Task
from proj.celery_app import app

logger = logging.getLogger(__name__)


@app.task
def cleanup() -> None:
    """Stands in for housekeeping (beat_schedule: every 10 seconds)."""
    logger.info("cleanup ran")


@app.task
def report(kind: str) -> None:
    """Stands in for a report (beat_schedule: nightly at 02:30, London time)."""
    logger.info("%s report ran", kind)


@app.task
def lights(state: str) -> None:
    """Stands in for home automation (beat_schedule: at sunrise in London)."""
    logger.info("lights %s", state)


@app.task
def launch() -> None:
    """Stands in for a one-off (beat_schedule: a clocked time)."""
    logger.info("launched")


@app.task(base=Task, schedule=5.0, misfire="skip")
def heartbeat() -> None:
    """Declared with the decorator: every 5 seconds; missed beats are not caught up."""
    logger.info("heartbeat")


@app.task(base=Task, schedule=crontab(minute="*"), overlap="skip")
def refresh_dashboard() -> None:
    """Declared with the decorator: every minute, never two at once."""
    logger.info("dashboard refreshed")
