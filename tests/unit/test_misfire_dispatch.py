"""Misfire at first dispatch (issue 15, point 5): occurrences planned ahead
that a leader sends late follow the schedule's misfire policy.

A real :class:`~celery_sched.leader.Engine` with its planner, on the memory
backends and one fake clock: the leader runs, then nothing runs for a while
(a leader gap shorter than the plan horizon, so the missed occurrences were
all materialized before it), then a leader runs again. What each policy
sends late, and what becomes ``missed``, is counted from the dispatcher.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

import pytest
from celery import Celery

from celery_sched import schedules
from celery_sched.client import Client
from celery_sched.dispatch.memory import MemoryDispatcher
from celery_sched.leader import Engine
from celery_sched.leader.planning import Planner
from celery_sched.lease.elector import LeaderElector
from celery_sched.lease.memory import MemoryLeaseBackend
from celery_sched.models import JobStatus, MisfirePolicy, ScheduleSpec
from celery_sched.settings import Settings
from celery_sched.staging.memory import MemoryStaging
from celery_sched.store.memory import MemoryJobStore

START = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
S = dt.timedelta(seconds=1)


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def wall(self) -> dt.datetime:
        return START + dt.timedelta(seconds=self.offset)

    def mono(self) -> float:
        return 1000.0 + self.offset


@dataclasses.dataclass
class Rig:
    clock: Clock
    store: MemoryJobStore
    dispatcher: MemoryDispatcher
    client: Client
    engine: Engine

    def run(self, seconds: float, step: float = 0.1) -> None:
        """Lead for ``seconds`` of fake time (renewing the lease)."""
        end = self.clock.offset + seconds
        renew_at = self.clock.offset
        while self.clock.offset < end - 1e-9:
            if self.clock.offset >= renew_at:
                elector = self.engine.elector
                if elector.current() is not None:
                    elector.renew()
                else:
                    elector.try_acquire()
                renew_at = self.clock.offset + 1.0
            self.engine.step()
            self.clock.offset += step

    def gap(self, seconds: float) -> None:
        """Nobody leads for ``seconds``: the lease runs out, nothing is sent."""
        self.clock.offset += seconds

    def sent(self, name: str) -> list[float]:
        """Due times (seconds after START) of the published occurrences of ``name``."""
        dues = []
        for job_id in self.dispatcher.sent_ids():
            job = self.store.get_by_id(job_id)
            assert job is not None
            if job.key.startswith(name + "@"):
                dues.append((job.due_at - START) / S)
        return dues

    def with_status(self, name: str, status: JobStatus) -> list[float]:
        return sorted(
            (job.due_at - START) / S
            for job in self.store._jobs.values()
            if job.key.startswith(name + "@") and job.status is status
        )


def _tick(*args: Any) -> None:
    """The scheduled task."""


def make_rig(**overrides: Any) -> Rig:
    clock = Clock()
    app = Celery("misfire-dispatch-tests", set_as_current=False)
    app.conf.timezone = "UTC"
    app.task(name="t.tick")(_tick)
    values: dict[str, Any] = {
        "lease_ttl": 3.0,
        "lease_safety_margin": 0.3,
        "plan_horizon": 60.0,
        "misfire_grace": 0.5,
        "staging_window": 30.0,
        "sweep_interval": 1.0,
        "visibility_timeout": 600.0,
    }
    values.update(overrides)
    settings = Settings(**values)
    store = MemoryJobStore(clock=clock.wall)
    lease = MemoryLeaseBackend(clock=clock.mono)
    elector = LeaderElector(
        lease,
        shard=0,
        ttl=settings.lease_ttl,
        safety_margin=settings.lease_safety_margin,
        acquire_epoch=store.acquire_epoch,
        holder="beat-1",
        clock=clock.mono,
    )
    dispatcher = MemoryDispatcher()
    engine = Engine(
        store=store,
        staging=MemoryStaging(),
        dispatcher=dispatcher,
        elector=elector,
        settings=settings,
        clock=clock.mono,
        wall=clock.wall,
        planner=Planner(store, settings, app=app, clock=clock.mono),
    )
    client = Client(app, settings=settings, store=store, staging=False)
    return Rig(clock, store, dispatcher, client, engine)


@pytest.mark.parametrize(
    ("policy", "late_sent"),
    [
        ("once", [22.0]),  # only the latest missed instant
        ("skip", []),
        ("all", [18.0, 20.0, 22.0]),  # max_catchup 3: the latest three
    ],
)
def test_a_short_leader_gap_sends_what_the_policy_says(policy: str, late_sent: list[float]) -> None:
    """A 2 s schedule, a 15 s gap (the issue's case): under stock beat's
    ``once`` one late run, not seven."""
    rig = make_rig(max_catchup=3)
    rig.client.schedules.add("two", "t.tick", 2, misfire=policy)
    rig.run(8.05)  # sends 2, 4, 6, 8 on time; occurrences up to 68 s are planned
    assert rig.sent("two") == [2.0, 4.0, 6.0, 8.0]
    rig.gap(14.6)  # nobody leads from 8.15 to 22.75: 10..22 are missed
    rig.run(10.0)
    sent = rig.sent("two")
    assert sent[:4] == [2.0, 4.0, 6.0, 8.0]
    late = [due for due in sent[4:] if due <= 22.0]
    assert late == late_sent
    assert sent[4 + len(late) :] == [24.0, 26.0, 28.0, 30.0, 32.0]
    missed = rig.with_status("two", JobStatus.MISSED)
    assert missed == [due for due in (10.0, 12.0, 14.0, 16.0, 18.0, 20.0, 22.0) if due not in late]
    assert rig.engine.stats.missed == len(missed)
    row = rig.store.get("two@2026-03-01T12:00:10Z")
    assert row is not None and row.last_error is not None
    assert row.last_error.startswith("missed: ") and f"misfire {policy}" in row.last_error
    assert row.finished_at is not None and row.attempt == 0
    assert len(sent) == len(set(sent))  # nothing twice


def test_occurrences_late_within_the_grace_are_sent() -> None:
    """A leader a little late (under ``misfire_grace``) misses nothing."""
    rig = make_rig(misfire_grace=5.0)
    rig.client.schedules.add("two", "t.tick", 2, misfire="skip")
    rig.run(4.05)
    rig.gap(4.0)  # 6 and 8 are at most 3 s late when sent
    rig.run(2.0)
    assert rig.sent("two") == [2.0, 4.0, 6.0, 8.0, 10.0]
    assert rig.with_status("two", JobStatus.MISSED) == []


def test_a_requeued_occurrence_follows_max_attempts_not_the_policy() -> None:
    """An occurrence sent once and requeued since (attempt 1) is sent again
    however late, since it may never have run."""
    rig = make_rig(visibility_timeout=5.0, reconcile_interval=1.0)
    rig.store.heartbeat("worker@test", 4242)  # a tracked deployment: requeues happen
    rig.client.schedules.add("once", "t.tick", schedules.clocked(START + 2 * S), misfire="skip")
    rig.run(2.55)
    assert rig.sent("once") == [2.0]
    rig.gap(30.0)  # no worker took it: the next leader's reconciler requeues it
    rig.run(3.0)
    assert rig.sent("once") == [2.0, 2.0]
    job = rig.store.get("once@2026-03-01T12:00:02Z")
    assert job is not None and job.attempt == 1 and job.status is JobStatus.DISPATCHED


def test_a_triggered_run_is_never_judged_late() -> None:
    rig = make_rig()
    rig.client.schedules.add("daily", "t.tick", 86400, misfire="skip")
    rig.run(1.05)
    triggered = rig.client.schedules.trigger("daily")
    assert triggered is not None
    rig.gap(20.0)  # the trigger waits 20 s for a leader
    rig.run(1.0)
    assert rig.dispatcher.sent_ids() == [triggered.id]


def test_kept_late_judges_against_every_instant_of_the_schedule() -> None:
    """The latest missed instant decides, whether or not it is in the batch."""
    spec = ScheduleSpec(
        name="s", task="t", kind="interval", spec={"seconds": 10.0}, misfire=MisfirePolicy.ONCE
    )
    now = START + 100 * S
    kwargs: dict[str, Any] = {
        "now": now,
        "default_misfire": "once",
        "catchup_window": 3600.0,
        "max_catchup": 5,
        "grace": 1.0,
    }
    dues = [START + k * 10 * S for k in (3, 4, 5)]
    # 90 s is the latest instant missed: none of these three runs.
    assert schedules.kept_late(spec, dues, **kwargs) == set()
    assert schedules.kept_late(spec, [*dues, START + 90 * S], **kwargs) == {START + 90 * S}
    # Not missed: within the grace.
    assert schedules.kept_late(spec, [now - 0.5 * S], **kwargs) == {now - 0.5 * S}
    every = dataclasses.replace(spec, misfire=MisfirePolicy.ALL, catchup_window=35.0)
    assert schedules.kept_late(every, dues + [START + k * 10 * S for k in (7, 8, 9)], **kwargs) == {
        START + 70 * S,
        START + 80 * S,
        START + 90 * S,
    }
    every_minute = {
        "minute": "*",
        "hour": "*",
        "day_of_week": "*",
        "day_of_month": "*",
        "month_of_year": "*",
    }
    crontab = ScheduleSpec(
        name="c", task="t", kind="crontab", spec=every_minute, misfire=MisfirePolicy.ONCE
    )
    minutes = [START + dt.timedelta(minutes=k) for k in (-3, -2, -1)]
    assert schedules.kept_late(crontab, minutes, **{**kwargs, "now": START - 30 * S}) == {
        START - dt.timedelta(minutes=1)
    }
