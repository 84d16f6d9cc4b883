"""The job store and the idempotency ledger: PostgreSQL
(:mod:`celery_sched.store.postgres`), the in-memory fakes of unit tests
(:mod:`celery_sched.store.memory`: the job store and the ledger),
and the schema they share (:mod:`celery_sched.store.schema`).

Kept light on purpose: importing this package loads neither the database
driver nor Alembic. Import the backends from their packages.
"""

from __future__ import annotations

from celery_sched.store.schema import build_metadata

__all__ = ["build_metadata"]
