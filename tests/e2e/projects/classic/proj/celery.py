"""The app: every setting comes from ``proj.celeryconfig``."""

from __future__ import annotations

from celery import Celery

app = Celery("proj")
app.config_from_object("proj.celeryconfig")

# The publish receivers must be connected wherever tasks are sent from.
import proj.signals  # noqa: E402, F401
