"""The leader: what the beat process holding a shard's lease does.

One module per duty, each with its interval and what its failure does:

- :mod:`~celery_sched.leader.fleet`: :class:`~celery_sched.leader.fleet.Fleet`,
  a beat's engines, one per shard it competes for, and the balancing of the
  shards between beats (:mod:`~celery_sched.leader.balancing`: who should
  lead which shard).
- :mod:`~celery_sched.leader.loop`: :class:`Engine`, one shard's loop and its
  timers; :meth:`Engine.step` runs the duties that are due and never raises.
- :mod:`~celery_sched.leader.staging`: copying jobs due soon into Redis.
- :mod:`~celery_sched.leader.claiming`: claiming staged ids when due, and
  publishing them (the fast path).
- :mod:`~celery_sched.leader.sweeping`: claiming due rows straight from
  Postgres (the fallback path, and backlogs).
- :mod:`~celery_sched.leader.publishing`: publishing a claimed batch and
  settling what did not go out (shared by the two above).
- :mod:`~celery_sched.leader.misfire`: late occurrences the misfire policy
  drops at their first dispatch (asked by the publisher).
- :mod:`~celery_sched.leader.planning`: driving the periodic-schedule planner.
- :mod:`~celery_sched.leader.reconciler`: requeuing dispatched jobs no worker
  started (also ``celery -A proj sched reconcile``).
- :mod:`~celery_sched.leader.rescuer`: rescuing the running jobs of worker
  processes that died.
- :mod:`~celery_sched.leader.housekeeping`: pruning what outlived its retention.
- :mod:`~celery_sched.leader.backlog`: reading the job counts, the backlog's
  age and the staging set's size for the gauges of :mod:`celery_sched.metrics`.
- :mod:`~celery_sched.leader.clock` and :mod:`~celery_sched.leader.stats`:
  the store's time as the leader estimates it, and the counters.

The election itself is :class:`~celery_sched.lease.elector.LeaderElector`;
:func:`celery_sched.backends.build_fleet` assembles a beat's fleet from
settings, :func:`celery_sched.backends.build_leader` one shard's engine.
"""

from __future__ import annotations

from celery_sched.leader.loop import Engine
from celery_sched.leader.stats import EngineStats

__all__ = ["Engine", "EngineStats"]
