"""The PostgreSQL job store (:mod:`celery_sched.store.postgres`) and its schema.

Kept light on purpose: importing this package loads neither the database
driver nor Alembic. Import :class:`~celery_sched.store.postgres.PostgresJobStore`
from its module.
"""

from __future__ import annotations

from celery_sched.store.schema import build_metadata

__all__ = ["build_metadata"]
