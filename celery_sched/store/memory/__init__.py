"""An in-memory :class:`~celery_sched.interfaces.JobStore` for unit tests.

It mirrors the PostgreSQL store's semantics exactly (the contract suites in
``tests/contract`` run against both): one lock stands in for transactions,
and the injectable ``clock`` plays Postgres ``now()``. Nothing here is meant
for production: everything is lost with the process.

Laid out as :mod:`celery_sched.store.postgres` is: one module per role of the
store (:mod:`.jobs`, :mod:`.worker_reports`, :mod:`.schedules`) over the
state they share (:mod:`.base`), composed in :mod:`.store`; the
idempotency ledger's fake is :mod:`.ledger`. The roles share
every row (a schedule's occurrences are jobs, a worker's report moves a
job), so the state lives in the one object that inherits them all.
"""

from __future__ import annotations

from celery_sched.store.memory.ledger import MemoryLedger
from celery_sched.store.memory.store import MemoryJobStore

__all__ = ["MemoryJobStore", "MemoryLedger"]
