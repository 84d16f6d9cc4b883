"""Where ``backends.py`` still imports :class:`PostgresLedger` from; it lives in
:mod:`celery_sched.store.postgres.ledger`. Delete this module once
``backends.py`` imports from there."""

from __future__ import annotations

from celery_sched.store.postgres.ledger import PostgresLedger

__all__ = ["PostgresLedger"]
