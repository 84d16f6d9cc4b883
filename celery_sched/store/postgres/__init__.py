"""The PostgreSQL backends: the job store and the idempotency ledger.

One module per concern:

- :mod:`.connection`: how every backend here reaches the database
  (:class:`~.connection.Database`: the pool, the worker threads' own
  connections, the one retry helper and the one translation of driver
  errors into :mod:`celery_sched.errors`);
- :mod:`.statements`: the statements people run ``EXPLAIN`` on (claims,
  requeues, workers' reports, the ledger's take and completion), named, in
  one place; ``python -m celery_sched.store.postgres`` prints them as SQL;
- :mod:`.base`: what the store's roles share (database, statements,
  migrations, clock);
- :mod:`.jobs`, :mod:`.worker_reports`, :mod:`.schedules` (statements in
  :mod:`.schedule_queries`): one role of
  :class:`~celery_sched.interfaces.JobStore` each;
- :mod:`.bulk`: COPY of new jobs and schedules;
- :mod:`.ledger`: :class:`~celery_sched.interfaces.Ledger`, sharing a
  store's database;
- :mod:`.store`: :class:`PostgresJobStore`, every role in one object.

Why the roles are composed by inheritance rather than delegation: each role
class is a complete implementation of its interface over the shared base
(one :class:`~.connection.Database` and one set of statements, set up by the
base's ``__init__``), the roles' methods do not overlap, and so the composite
is just the three classes together, with nothing to forward: delegation
would need a forwarding method for each of the roles' forty-odd methods.
Each role class can also be built alone where a caller needs only that role.
"""

from __future__ import annotations

from celery_sched.store.postgres.base import MIGRATIONS_DIR
from celery_sched.store.postgres.bulk import COPY_COLUMNS
from celery_sched.store.postgres.ledger import PostgresLedger
from celery_sched.store.postgres.store import PostgresJobStore

__all__ = ["COPY_COLUMNS", "MIGRATIONS_DIR", "PostgresJobStore", "PostgresLedger"]
