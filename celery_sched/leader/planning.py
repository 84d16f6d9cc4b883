"""Planning: turning periodic schedules into jobs, a time-boxed pass per tick.

Placeholder: the planner itself (:class:`~celery_sched.planner.Planner`,
``celery_sched/planner.py``) moves into this package later; for now this
module holds only the duty that drives it from the loop.

Once elected, the leader of shard 0 syncs the static schedules (the code's
``beat_schedule`` and decorated tasks) into the store, so a deploy that
changed them is picked up. Then every tick the leader materializes the
occurrences of its shard's schedules up to the planning horizon, with a time
budget per pass so dispatching is never held up for long. Occurrences its
stager has already passed are staged at once.

Failures: static schedules that fail validation are logged at ERROR and not
retried until the next election (they were checked when beat started;
retrying cannot help). Anything else the planner raises propagates: the loop
logs and counts a failed ``plan`` and tries again after its backoff.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from celery_sched.errors import InvalidJob, InvalidSchedule

if TYPE_CHECKING:
    from celery_sched.leader.staging import Stager
    from celery_sched.leader.stats import EngineStats
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.planner import Planner
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Longest one planning pass may run before the loop dispatches again, in seconds.
PLAN_BUDGET = 0.25


class Planning:
    """Drives one shard's :class:`~celery_sched.planner.Planner` from the loop."""

    def __init__(
        self,
        planner: Planner,
        *,
        elector: LeaderElector,
        settings: Settings,
        stats: EngineStats,
        stager: Stager,
    ) -> None:
        self._planner = planner
        self._elector = elector
        self._stats = stats
        self._stager = stager
        self._shard = settings.shard
        self._shards = settings.shards
        #: Seconds between passes once a pass finished within its budget (a
        #: pass cut short goes on right after dispatching).
        self.interval = min(settings.max_tick, 1.0)
        self._sync_due = False

    def elected(self) -> None:
        """Shard 0's leader owns the static schedules: sync them on every
        election, which picks up a deploy that changed them."""
        self._sync_due = self._shard == 0

    def run(self) -> bool:
        """Sync static schedules if due, then one planning pass; True if more is left."""
        if not self._elector.is_leader():
            return False
        if self._sync_due:
            try:
                synced = self._planner.sync_static()
            except (InvalidSchedule, InvalidJob) as exc:
                # The code's schedules were checked when beat started, so this
                # is rare; retrying cannot help, dispatching must go on.
                logger.error("static schedules not synced: %s", exc)
            else:
                logger.info(
                    "static schedules synced: %d added, %d changed, %d disabled, %d unchanged",
                    synced.added,
                    synced.updated,
                    synced.disabled,
                    synced.unchanged,
                )
            self._sync_due = False
        planned = self._planner.plan_pass(
            shard=self._shard, shards=self._shards, budget=PLAN_BUDGET
        )
        self._stats.planned += len(planned.written)
        self._stager.stage_planned(planned.written)
        return planned.more
