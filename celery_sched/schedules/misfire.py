"""Misfire: which occurrences of a schedule to materialize now, and what
happens to those missed while no planner ran (:func:`plan`); and which of
those materialized ahead of time still run when a leader sends them late
(:func:`kept_late`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence

from celery_sched.models import MisfirePolicy, ScheduleSpec
from celery_sched.schedules.evaluate import compile_spec, utc_argument
from celery_sched.schedules.rows import cursor_before


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What :func:`plan` decided for one schedule."""

    #: Nominal UTC instants to materialize now, ascending, no duplicates.
    occurrences: list[dt.datetime]
    #: Missed occurrences dropped by the misfire policy.
    skipped: int
    #: The new ``last_nominal_at``: the last instant considered (materialized
    #: or skipped). For a brand-new schedule with nothing to materialize yet,
    #: the instant its first occurrence was computed from, so that the next
    #: call continues from there (``next_after(cursor) == next_nominal``).
    #: None only when the schedule never fires.
    cursor: dt.datetime | None
    #: ``next_after(cursor)``: the next occurrence not yet materialized (None
    #: when the schedule is exhausted).
    next_nominal: dt.datetime | None


def plan(
    spec: ScheduleSpec,
    *,
    last_nominal: dt.datetime | None,
    now: dt.datetime,
    horizon: dt.datetime,
    default_misfire: MisfirePolicy | str,
    catchup_window: float,
    max_catchup: int,
    grace: float,
    limit: int = 1000,
) -> Plan:
    """Decide which occurrences of ``spec`` to materialize now.

    Occurrences come after ``last_nominal`` (the previous plan's cursor) and
    are at or before ``horizon``. One is *missed* when its nominal instant is
    before ``now - grace``. Missed ones follow the misfire policy
    (``spec.misfire``, else ``default_misfire``):

    - ``skip``: none runs;
    - ``once``: only the latest missed one runs;
    - ``all``: each missed one whose nominal instant is within
      ``catchup_window`` seconds of ``now`` runs, at most ``max_catchup`` of
      them, the latest kept (``spec.catchup_window`` / ``spec.max_catchup``
      override the arguments, which are the project defaults).

    Every future occurrence (``now - grace`` up to ``horizon``) is
    materialized, at most ``limit`` in one call; the cursor stops at the last
    one returned so the next call continues there. ``last_nominal=None``
    means a brand-new schedule: it starts at :func:`first_after` ``(now)``
    and nothing is missed. ``spec.enabled`` is not consulted: whether a
    schedule is planned at all is the caller's decision.

    Guarantees: occurrences are ascending and unique, all after
    ``last_nominal``; at most ``max_catchup`` missed ones plus ``limit``
    future ones; ``skipped`` counts exactly the missed ones not returned.
    A long outage costs little: missed occurrences are counted and the kept
    ones found without visiting each (intervals by arithmetic, crontabs a
    whole day at a time).
    """
    if type(limit) is not int or limit < 1:
        raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
    now = utc_argument(now, "now")
    horizon = utc_argument(horizon, "horizon")
    compiled = compile_spec(spec)
    policy = spec.misfire or MisfirePolicy(default_misfire)
    window = catchup_window if spec.catchup_window is None else spec.catchup_window
    most = max_catchup if spec.max_catchup is None else spec.max_catchup
    cutoff = now - dt.timedelta(seconds=grace)

    occurrences: list[dt.datetime] = []
    skipped = 0
    cursor: dt.datetime | None
    if last_nominal is None:
        cursor = compiled.anchor(now)
        upcoming = compiled.next_after(cursor)
        if upcoming is None:
            cursor = None
    else:
        cursor = utc_argument(last_nominal, "last_nominal")
        upcoming = compiled.next_after(cursor)
        if upcoming is not None and upcoming < cutoff:
            if policy is MisfirePolicy.ONCE:
                kept = compiled.latest(cursor, None, cutoff, 1)
            elif policy is MisfirePolicy.ALL and most > 0 and window >= 0:
                try:
                    floor: dt.datetime | None = now - dt.timedelta(seconds=window)
                except OverflowError:  # an unbounded window
                    floor = None
                kept = compiled.latest(cursor, floor, cutoff, most)
            else:
                kept = []
            latest = kept[-1] if kept else compiled.latest(cursor, None, cutoff, 1)[-1]
            skipped = compiled.count(cursor, cutoff) - len(kept)
            occurrences.extend(kept)
            cursor = latest
            upcoming = compiled.next_after(latest)

    future = 0
    while upcoming is not None and upcoming <= horizon and future < limit:
        occurrences.append(upcoming)
        cursor = upcoming
        future += 1
        upcoming = compiled.next_after(upcoming)
    return Plan(occurrences=occurrences, skipped=skipped, cursor=cursor, next_nominal=upcoming)


def kept_late(
    spec: ScheduleSpec,
    late: Sequence[dt.datetime],
    *,
    now: dt.datetime,
    default_misfire: MisfirePolicy | str,
    catchup_window: float,
    max_catchup: int,
    grace: float,
) -> set[dt.datetime]:
    """Which of the occurrences ``late`` of ``spec``, about to be sent for the
    first time at ``now``, the misfire policy still runs.

    The same rule as :func:`plan`, applied when an occurrence that was
    materialized ahead of time is dispatched instead of when it is planned:
    an occurrence is *missed* when its nominal instant is before ``now -
    grace`` (those in ``late`` that are not are kept). Among the missed ones,
    judged against every instant of the schedule, not only those in
    ``late``: ``skip`` keeps none; ``once`` keeps the latest instant missed,
    if it is in ``late``; ``all`` keeps the latest ``max_catchup`` instants
    missed within ``catchup_window`` seconds of ``now``. So after a gap of
    any length one schedule runs its missed occurrences as the policy says,
    however many were materialized and in whichever batches they come.
    """
    now = utc_argument(now, "now")
    cutoff = now - dt.timedelta(seconds=grace)
    missed = sorted(nominal for nominal in set(late) if nominal < cutoff)
    kept = {nominal for nominal in late if nominal >= cutoff}
    if not missed:
        return kept
    policy = spec.misfire or MisfirePolicy(default_misfire)
    if policy is MisfirePolicy.SKIP:
        return kept
    window = catchup_window if spec.catchup_window is None else spec.catchup_window
    most = max_catchup if spec.max_catchup is None else spec.max_catchup
    compiled = compile_spec(spec)
    # A cursor whose next instant is the earliest missed one: intervals step
    # from their cursor, so it must lie exactly one step before.
    cursor = cursor_before(spec, missed[0])
    if policy is MisfirePolicy.ONCE:
        latest = compiled.latest(cursor, None, cutoff, 1)
    elif most > 0 and window >= 0:
        try:
            floor: dt.datetime | None = now - dt.timedelta(seconds=window)
        except OverflowError:  # an unbounded window
            floor = None
        latest = compiled.latest(cursor, floor, cutoff, most)
    else:
        latest = []
    return kept | (set(latest) & set(missed))
