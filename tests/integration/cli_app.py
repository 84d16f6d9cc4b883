"""A tiny Celery app for the ``celery -A tests.integration.cli_app sched`` tests.

celery_sched settings come from ``CELERY_SCHED_*`` environment variables, so
each test points it at its own schema.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("cli_app", broker="memory://", set_as_current=False)
app.conf.update(timezone="UTC")
# A test of the CLI with an app that serializes with pickle (and accepts it).
if os.environ.get("CLI_APP_SERIALIZER"):
    app.conf.update(
        task_serializer=os.environ["CLI_APP_SERIALIZER"],
        accept_content=[os.environ["CLI_APP_SERIALIZER"], "json"],
    )


@app.task(name="cli_app.ping", shared=False)
def ping() -> str:
    return "pong"
