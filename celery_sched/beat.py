"""The drop-in face: ``celery -A proj beat -S celery_sched``.

:class:`Scheduler` is a ``celery.beat.Scheduler`` whose ``tick`` runs one pass
of the :class:`~celery_sched.engine.Engine` and returns how long to sleep.
Constructed with ``lazy=True`` (as the start-up banner does) it connects to
nothing. It touches neither SQL nor Redis itself: it wires the backends built
by :mod:`celery_sched.backends` into the engine.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from celery import beat

from celery_sched.settings import Settings

logger = logging.getLogger(__name__)


class Scheduler(beat.Scheduler):
    """Celery beat scheduler backed by PostgreSQL, Redis and a fenced lease."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._engine: Any = None
        self._settings: Settings | None = None
        super().__init__(app, *args, **kwargs)

    # -- celery.beat.Scheduler overrides -----------------------------------

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_app(self.app)
        return self._settings

    def setup_schedule(self) -> None:
        from celery_sched.backends import (
            build_dispatcher,
            build_redis,
            build_staging,
            build_store,
        )
        from celery_sched.backends import build_lease as build_lease_backend
        from celery_sched.engine import Engine
        from celery_sched.lease import LeaderElector

        settings = self.settings
        store = build_store(settings)
        # Idempotent and serialized by an advisory lock, so every beat of a
        # fleet may run it at start; the first one creates the schema.
        store.migrate()
        redis_client = build_redis(settings)
        elector = LeaderElector(
            build_lease_backend(settings, redis_client),
            shard=settings.shard,
            ttl=settings.lease_ttl,
            safety_margin=settings.lease_safety_margin,
            acquire_epoch=store.acquire_epoch,
            holder=f"{socket.gethostname()}:{os.getpid()}",
        )
        self._engine = Engine(
            store=store,
            staging=build_staging(settings, redis_client),
            dispatcher=build_dispatcher(self.app, settings),
            elector=elector,
            settings=settings,
        )
        self._engine.start()
        logger.info(
            "celery_sched: shard %d competing for the lease (store %s, redis %s)",
            settings.shard,
            settings.safe_database_url,
            settings.safe_redis_url,
        )

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._engine is None:
            self.setup_schedule()
        delay: float = self._engine.step()
        return delay

    def should_sync(self) -> bool:
        return False

    def sync(self) -> None:
        """Nothing to persist: every state change is already in Postgres."""

    def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.stop()
        super().close()

    @property
    def info(self) -> str:
        settings = self.settings
        lines = [
            f"    . shard -> {settings.shard} of {settings.shards}",
            f"    . store -> {settings.safe_database_url} (schema {settings.db_schema})",
            f"    . redis -> {settings.safe_redis_url} (prefix {settings.key_prefix})",
        ]
        if self._engine is not None:
            lines.insert(0, f"    . role -> {self._engine.role} (epoch {self._engine.epoch})")
        else:
            lines.insert(0, "    . role -> not started")
        return "\n".join(lines)
