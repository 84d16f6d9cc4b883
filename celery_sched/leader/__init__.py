"""The leader: what the beat process holding a shard's lease does.

One module per duty, each with its interval and what its failure does:

- :mod:`~celery_sched.leader.loop`: :class:`Engine`, the loop and its timers;
  :meth:`Engine.step` runs the duties that are due and never raises.
- :mod:`~celery_sched.leader.staging`: copying jobs due soon into Redis.
- :mod:`~celery_sched.leader.claiming`: claiming staged ids when due, and
  publishing them (the fast path).
- :mod:`~celery_sched.leader.sweeping`: claiming due rows straight from
  Postgres (the fallback path, and backlogs).
- :mod:`~celery_sched.leader.publishing`: publishing a claimed batch and
  settling what did not go out (shared by the two above).
- :mod:`~celery_sched.leader.planning`: driving the periodic-schedule planner.
- :mod:`~celery_sched.leader.reconciler`: requeuing dispatched jobs no worker
  started (also ``celery -A proj sched reconcile``).
- :mod:`~celery_sched.leader.rescuer`: rescuing the running jobs of worker
  processes that died.
- :mod:`~celery_sched.leader.housekeeping`: pruning what outlived its retention.
- :mod:`~celery_sched.leader.clock` and :mod:`~celery_sched.leader.stats`:
  the store's time as the leader estimates it, and the counters.

The election itself is :class:`~celery_sched.lease.elector.LeaderElector`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from celery_sched.leader.loop import Engine
from celery_sched.leader.stats import EngineStats

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore
    from celery_sched.models import ScheduleSpec
    from celery_sched.settings import Settings

__all__ = ["Engine", "EngineStats", "build_leader"]


def build_leader(
    app: Any, settings: Settings, *, store: JobStore, static: Sequence[ScheduleSpec]
) -> Engine:
    """Assemble this process's leader for ``settings.shard``, not yet started.

    ``store`` is the job store the caller opened (and migrated); the elector
    bumps its epochs, and the ledger shares its pool. The rest is built here
    from ``settings``: the Redis lease and staging (one client), the broker
    dispatcher, the idempotency ledger, and the planner of ``static`` (the
    code's periodic schedules). Connects to nothing until used. Call
    :meth:`Engine.start` to compete for the lease.
    """
    from celery_sched.backends import (
        build_dispatcher,
        build_lease,
        build_ledger,
        build_redis,
        build_staging,
    )
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.planner import Planner

    redis_client = build_redis(settings)
    elector = LeaderElector(
        build_lease(settings, redis_client),
        shard=settings.shard,
        ttl=settings.lease_ttl,
        safety_margin=settings.lease_safety_margin,
        acquire_epoch=store.acquire_epoch,
        holder=f"{socket.gethostname()}:{os.getpid()}",
    )
    return Engine(
        store=store,
        staging=build_staging(settings, redis_client),
        dispatcher=build_dispatcher(app, settings),
        elector=elector,
        settings=settings,
        planner=Planner(store, settings, app=app, static=static),
        ledger=build_ledger(settings, store),
    )
