"""The web console (``celery -A proj sched web``): server-rendered pages over
the same :class:`~celery_sched.client.Client` the command line uses.

Needs the ``web`` extra (Starlette, Jinja2, uvicorn, python-multipart).
"""

from __future__ import annotations

from celery_sched.web.app import create_app

__all__ = ["create_app"]
