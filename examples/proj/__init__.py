"""An example Celery project scheduled by celery_sched.

``celery -A proj ...`` finds the app through the ``app`` name below.
"""

from __future__ import annotations

from proj.celery_app import app

__all__ = ["app"]
