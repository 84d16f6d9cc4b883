"""Periodic schedules: Celery beat entries in, nominal UTC instants out. No I/O.

The planner (``celery_sched.leader.planning``) turns each periodic schedule into one
job row per occurrence, keyed :func:`occurrence_key`. Everything it needs to
know about *when* lives here, as pure functions of a
:class:`~celery_sched.models.ScheduleSpec` and instants handed in by the
caller (the store's clock), so every rule is unit-tested without services.
One module per concern:

- :mod:`~celery_sched.schedules.spec`: **sources**. :func:`make_spec` accepts
  every schedule beat knows (:class:`celery.schedules.crontab`,
  :class:`~celery.schedules.schedule`, ``timedelta``, seconds,
  :class:`~celery.schedules.solar`), a cron string and :class:`clocked`
  one-offs, and checks everything before anything could be written.
  :func:`specs_from_app` reads ``beat_schedule`` (including
  ``add_periodic_task`` entries) and decorator-declared tasks.
- :mod:`~celery_sched.schedules.cron`: **crontab**, evaluated on the wall
  clock of the schedule's timezone. ``day_of_week`` and ``day_of_month`` are
  ANDed, as Celery's crontab does (classic cron ORs them).
- :mod:`~celery_sched.schedules.wallclock`: **DST**, by Vixie/Debian cron's
  rule. A *fixed-time* crontab (minute and hour fields not starting with
  ``*``) fires once at the first valid instant after a gap (clocks spring
  forward) and once, at its first instant, for a repeated local time (clocks
  fall back); a *wildcard* crontab (``0 * * * *``, ``*/15 * * * *``) runs by
  the new wall clock: every real occurrence through a fold, none for the
  skipped times of a gap.
- :mod:`~celery_sched.schedules.interval`: **intervals** step in absolute
  time from the previous *nominal* instant, so nothing drifts however late
  the planner runs.
- :mod:`~celery_sched.schedules.solar`: **solar** events come from
  :mod:`ephem`, set up as Celery's ``solar`` does.
- :mod:`~celery_sched.schedules.clocked_time`: **clocked** one-offs.
- :mod:`~celery_sched.schedules.evaluate`: the first and next instant of a
  spec, whatever its kind.
- :mod:`~celery_sched.schedules.misfire`: **misfire** policies decide what
  happens to occurrences missed while no planner ran (:func:`plan`), and
  to those planned ahead that a leader sends late (:func:`kept_late`).
- :mod:`~celery_sched.schedules.rows`: schedules as stored rows, and the
  job of one occurrence.
"""

from __future__ import annotations

from celery_sched.schedules.clocked_time import clocked
from celery_sched.schedules.cron import CRON_FIELDS
from celery_sched.schedules.evaluate import first_after, next_after
from celery_sched.schedules.misfire import Plan, kept_late, plan
from celery_sched.schedules.rows import MAX_NAME_LENGTH, occurrence_key
from celery_sched.schedules.spec import (
    ENTRY_KEYS,
    SpecBuilder,
    make_spec,
    schedule_from_spec,
    spec_from_entry,
    specs_from_app,
)

__all__ = [
    "CRON_FIELDS",
    "ENTRY_KEYS",
    "MAX_NAME_LENGTH",
    "Plan",
    "SpecBuilder",
    "clocked",
    "first_after",
    "kept_late",
    "make_spec",
    "next_after",
    "occurrence_key",
    "plan",
    "schedule_from_spec",
    "spec_from_entry",
    "specs_from_app",
]
