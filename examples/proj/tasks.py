"""The example's tasks: ordinary Celery tasks."""

from __future__ import annotations

import logging

from proj.celery_app import app

logger = logging.getLogger(__name__)


@app.task
def send_reminder(user_id: int, message: str) -> None:
    """Stands in for real work such as sending an e-mail."""
    logger.info("reminder for user %d: %s", user_id, message)
