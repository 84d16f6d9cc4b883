"""The one place that builds concrete backends from settings.

Everything else receives interfaces (:mod:`celery_sched.interfaces`), so unit
tests can hand in the in-memory fakes instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from celery_sched.settings import Settings

if TYPE_CHECKING:
    import redis

    from celery_sched.interfaces import Dispatcher, JobStore, LeaseBackend, Ledger, Staging


def build_store(settings: Settings) -> JobStore:
    """The PostgreSQL job store (lazy: connects on first use)."""
    from celery_sched.store.postgres import PostgresJobStore

    return PostgresJobStore(settings)


def build_redis(settings: Settings) -> redis.Redis:
    """A Redis client for the lease and staging (lazy: connects on first use)."""
    import redis as redis_lib

    return redis_lib.Redis.from_url(
        settings.redis_url,
        socket_timeout=max(1.0, settings.lease_ttl / 3),
        socket_connect_timeout=max(1.0, settings.lease_ttl / 3),
        health_check_interval=30,
    )


def build_lease(settings: Settings, client: redis.Redis | None = None) -> LeaseBackend:
    from celery_sched.lease.redis import RedisLeaseBackend

    # One lease operation plus its single quick retry must fit well inside
    # the renewal period (ttl/3), so a hung Redis cannot eat a whole period.
    return RedisLeaseBackend(
        client or build_redis(settings),
        prefix=settings.key_prefix,
        op_timeout=settings.lease_ttl / 6,
    )


def build_staging(settings: Settings, client: redis.Redis | None = None) -> Staging:
    from celery_sched.staging.redis import RedisStaging

    return RedisStaging(client or build_redis(settings), prefix=settings.key_prefix)


def build_dispatcher(app: Any, settings: Settings) -> Dispatcher:
    from celery_sched.dispatch.kombu import KombuDispatcher

    return KombuDispatcher(app, settings)


def build_ledger(settings: Settings, store: JobStore | None = None) -> Ledger:
    """The PostgreSQL idempotency ledger (lazy: connects on first use).

    Given the PostgreSQL job store of the same settings, the ledger shares
    its connection pool; otherwise it builds (and closes) a store of its own.
    """
    from celery_sched.store.ledger_postgres import PostgresLedger
    from celery_sched.store.postgres import PostgresJobStore

    if isinstance(store, PostgresJobStore) and store._settings == settings:
        return PostgresLedger(store)
    return PostgresLedger(PostgresJobStore(settings), owns_store=True)
