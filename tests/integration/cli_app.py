"""A tiny Celery app for the ``celery -A tests.integration.cli_app sched`` tests.

celery_sched settings come from ``CELERY_SCHED_*`` environment variables, so
each test points it at its own schema.
"""

from __future__ import annotations

from celery import Celery

app = Celery("cli_app", broker="memory://", set_as_current=False)
app.conf.update(timezone="UTC")


@app.task(name="cli_app.ping", shared=False)
def ping() -> str:
    return "pong"
