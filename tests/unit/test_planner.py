"""The periodic planner and ``Client.schedules`` on the memory store, with an injected clock."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab

from celery_sched import schedules
from celery_sched.client import Client
from celery_sched.errors import (
    InvalidSchedule,
    ScheduleExists,
    UnknownSchedule,
    UnknownTimezone,
)
from celery_sched.leader.planning import Planner
from celery_sched.models import JobStatus
from celery_sched.schedules.rows import broken_reason, cursor_before, first_nominal
from celery_sched.settings import Settings
from celery_sched.store.memory import MemoryJobStore

START = dt.datetime(2026, 3, 2, 12, 0, tzinfo=dt.UTC)  # a whole minute
S = dt.timedelta(seconds=1)


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)

    def at(self, seconds: float) -> None:
        self.now = START + dt.timedelta(seconds=seconds)


@dataclasses.dataclass
class Rig:
    clock: Clock
    app: Celery
    settings: Settings
    store: MemoryJobStore
    client: Client
    planner: Planner

    def plan(self) -> Any:
        return self.planner.plan_pass()

    def dues(self, name: str) -> list[float]:
        """Seconds after START of every occurrence of ``name``, ascending."""
        return sorted(
            (job.due_at - START) / S
            for job in self.store._jobs.values()
            if job.key.startswith(name + "@")
        )

    def run_due(self, *, status: JobStatus = JobStatus.SUCCEEDED) -> list[str]:
        """What a dispatcher plus workers would do now: every due pending job
        ends with ``status``. Returns their keys."""
        epoch = self.store.current_epoch(0) or self.store.acquire_epoch(0, "test")
        claimed = self.store.claim_due(shard=0, epoch=epoch, limit=10_000)
        for job in claimed:
            self.store.mark_running(job.id, worker="w")
            if status.finished:
                self.store.mark_finished(job.id, status)
        return [job.key for job in claimed]


def _tick(*args: Any, **kwargs: Any) -> None:
    """The task every test schedules."""


def make_rig(**settings: Any) -> Rig:
    clock = Clock()
    app = Celery("planner-tests", set_as_current=False)
    app.conf.timezone = "UTC"
    app.task(name="t.tick")(_tick)

    values: dict[str, Any] = {"plan_horizon": 60.0, "misfire_grace": 1.0}
    values.update(settings)
    config = Settings(**values)
    store = MemoryJobStore(clock=clock)
    client = Client(app, settings=config, store=store, staging=False)
    return Rig(clock, app, config, store, client, Planner(store, config, app=app))


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield make_rig()


# -- timing -------------------------------------------------------------------------------


def test_interval_materializes_up_to_the_horizon_without_drift(rig: Rig) -> None:
    info = rig.client.schedules.add("every10", "t.tick", 10, args=(1,))
    assert info.next_run_at == START + 10 * S and info.state == "active"
    result = rig.plan()
    assert result.schedules == 1 and len(result.written) == 6
    assert rig.dues("every10") == [10, 20, 30, 40, 50, 60]
    rig.clock.at(37.3)  # a late pass: the grid stays on the nominal instants
    rig.plan()
    assert rig.dues("every10") == [10, 20, 30, 40, 50, 60, 70, 80, 90]
    job = rig.store.get("every10@2026-03-02T12:00:10Z")
    assert job is not None and job.args == (1,) and job.schedule_id is not None


def test_crontab_in_its_timezone(rig: Rig) -> None:
    rig.clock.at(-3600)  # 11:00 UTC is 20:00 in Tokyo; 21:00 Tokyo is 12:00 UTC
    info = rig.client.schedules.add(
        "tokyo", "t.tick", crontab(minute="0", hour="21"), timezone="Asia/Tokyo"
    )
    assert info.next_run_at == START and info.timezone == "Asia/Tokyo"
    rig.clock.at(-30)
    rig.plan()
    assert rig.dues("tokyo") == [0]


@pytest.mark.parametrize(
    ("policy", "expected_missed"),
    [
        ("skip", []),
        ("once", [590]),
        # catch-up window 120 s keeps 480..590, max_catchup 5 the latest five
        ("all", [550, 560, 570, 580, 590]),
    ],
)
def test_misfire_after_downtime(policy: str, expected_missed: list[int]) -> None:
    rig = make_rig(catchup_window=120.0, max_catchup=5)
    rig.client.schedules.add("m", "t.tick", 10, misfire=policy)
    rig.plan()  # 10..60 materialized before the outage
    rig.clock.at(600)  # no planner for nine minutes
    result = rig.plan()
    future = [600, 610, 620, 630, 640, 650, 660]
    assert rig.dues("m") == [10, 20, 30, 40, 50, 60, *expected_missed, *future]
    assert result.skipped == 53 - len(expected_missed)  # 70..590 were missed


def test_default_misfire_comes_from_settings() -> None:
    rig = make_rig(misfire_policy="skip")
    rig.client.schedules.add("d", "t.tick", 10)
    rig.plan()
    rig.clock.at(300)
    rig.plan()
    assert [t for t in rig.dues("d") if 60 < t < 300] == []


def test_clocked_one_off_fires_once_even_if_added_late(rig: Rig) -> None:
    rig.client.schedules.add("soon", "t.tick", schedules.clocked(START + 30 * S))
    rig.client.schedules.add("past", "t.tick", schedules.clocked(START - 300 * S))
    rig.client.schedules.add(
        "past-skip", "t.tick", schedules.clocked(START - 300 * S), misfire="skip"
    )
    rig.plan()
    rig.clock.at(200)
    rig.plan()
    assert rig.dues("soon") == [30]
    assert rig.dues("past") == [-300]  # misfire "once": runs now, once
    assert rig.dues("past-skip") == []
    assert rig.client.schedules.get("soon").state == "finished"  # type: ignore[union-attr]


# -- overlap ---------------------------------------------------------------------------------


def test_overlap_skip_runs_one_at_a_time(rig: Rig) -> None:
    rig.client.schedules.add("o", "t.tick", 2, overlap="skip")
    rig.plan()
    assert rig.dues("o") == [2]  # one at a time, not up to the horizon
    rig.clock.at(2.1)
    rig.plan()
    assert rig.dues("o") == [2]  # the 2 s one is due and unfinished: wait
    assert rig.run_due() == ["o@2026-03-02T12:00:02Z"]  # it runs and finishes
    rig.clock.at(3)
    rig.plan()
    assert rig.dues("o") == [2, 4]
    rig.clock.at(4.2)
    assert rig.run_due(status=JobStatus.RUNNING) == ["o@2026-03-02T12:00:04Z"]
    rig.clock.at(6.5)  # still running when 6 s comes: 6 s is skipped
    result = rig.plan()
    assert result.skipped == 1 and rig.dues("o") == [2, 4]
    job = rig.store.get("o@2026-03-02T12:00:04Z")
    assert job is not None
    rig.store.mark_finished(job.id, JobStatus.SUCCEEDED)
    rig.clock.at(7)
    rig.plan()
    assert rig.dues("o") == [2, 4, 8]


def test_overlap_allow_does_not_wait(rig: Rig) -> None:
    rig.client.schedules.add("a", "t.tick", 2)
    rig.plan()
    rig.clock.at(2.1)
    rig.run_due(status=JobStatus.RUNNING)
    rig.clock.at(30)
    rig.plan()
    assert rig.dues("a") == list(range(2, 92, 2))


# -- runtime changes ------------------------------------------------------------------------


def test_pause_withdraws_and_resume_follows_the_misfire_policy(rig: Rig) -> None:
    rig.client.schedules.add("p", "t.tick", 10)
    rig.plan()
    rig.clock.at(5)
    paused = rig.client.schedules.pause("p")
    assert paused.state == "paused" and paused.next_run_at is None
    assert rig.dues("p") == []  # everything materialized was still in the future
    rig.clock.at(100)
    assert rig.plan().schedules == 0
    resumed = rig.client.schedules.resume("p")
    assert resumed.state == "active"
    rig.plan()
    # "once": of 10..90 missed while paused only the latest runs; then on time.
    assert rig.dues("p") == [90, 100, 110, 120, 130, 140, 150, 160]


def test_update_restarts_from_now_without_firing_at_once(rig: Rig) -> None:
    rig.client.schedules.add("u", "t.tick", 10)
    rig.plan()
    rig.clock.at(25)
    rig.run_due()  # 10 and 20 ran
    info = rig.client.schedules.update("u", schedule=30)
    assert info.spec == {"seconds": 30.0}
    assert info.next_run_at == START + 55 * S
    assert rig.dues("u") == [10, 20]  # 30..60 of the old definition are gone
    rig.plan()
    assert rig.dues("u") == [10, 20, 55, 85]
    assert info.last_run_at == START + 20 * S and info.last_status == JobStatus.SUCCEEDED


def test_a_cron_string_with_cron_only_forms_survives_an_update(rig: Rig) -> None:
    # The stored `L` is read back with cron's grammar (Celery's parser refuses it).
    rig.client.schedules.add("last", "t.tick", "0 9 L * *")
    info = rig.client.schedules.update("last", args=(2,))
    assert info.spec["day_of_month"] == "L" and info.args == (2,)
    assert info.next_run_at is not None and info.next_run_at.day in (28, 29, 30, 31)


def test_update_of_arguments_keeps_the_timing(rig: Rig) -> None:
    rig.client.schedules.add("args", "t.tick", 10, args=(1,), queue="q1")
    rig.plan()
    rig.clock.at(25)
    info = rig.client.schedules.update("args", args=(2,), queue=None, priority=5)
    assert info.args == (2,) and info.options == {"priority": 5}
    rig.plan()
    assert rig.dues("args") == [10, 20, 30, 40, 50, 60, 70, 80]
    old = rig.store.get("args@2026-03-02T12:00:20Z")
    new = rig.store.get("args@2026-03-02T12:00:30Z")
    assert old is not None and new is not None
    assert old.args == (1,) and old.options == {"queue": "q1"}
    assert new.args == (2,) and new.options == {"priority": 5}


def test_trigger_now(rig: Rig) -> None:
    rig.client.schedules.add("t", "t.tick", 3600, overlap="skip", args=(7,))
    rig.clock.at(12.5)
    job = rig.client.schedules.trigger("t")
    assert job is not None and job.due_at == START + 12.5 * S and job.args == (7,)
    assert job.key == "t@2026-03-02T12:00:12.500000Z"
    # Due and not finished: overlap "skip" refuses a second one.
    assert rig.client.schedules.trigger("t") is None
    rig.run_due()
    rig.client.schedules.pause("t")
    assert rig.client.schedules.trigger("t") is not None  # paused: manual runs still work
    with pytest.raises(UnknownSchedule):
        rig.client.schedules.trigger("nope")


def test_delete(rig: Rig) -> None:
    rig.client.schedules.add("gone", "t.tick", 10)
    rig.plan()
    rig.clock.at(15)
    assert rig.client.schedules.delete("gone") is True
    assert rig.dues("gone") == [10]  # due before the delete: kept
    assert rig.client.schedules.get("gone") is None
    assert rig.client.schedules.delete("gone") is False
    assert rig.plan().schedules == 0


def test_list_shows_next_and_last_run(rig: Rig) -> None:
    rig.client.schedules.add("b", "t.tick", 10)
    rig.client.schedules.add("a", "t.tick", crontab(minute="*/5"))
    rig.plan()
    rig.clock.at(12)
    rig.run_due()
    infos = rig.client.schedules.list()
    assert [i.name for i in infos] == ["a", "b"]
    a, b = infos
    assert a.kind == "crontab" and a.next_run_at == START + 300 * S and a.last_run_at is None
    assert b.next_run_at == START + 20 * S and b.last_run_at == START + 10 * S
    assert b.last_status == JobStatus.SUCCEEDED
    assert rig.client.schedules.counts() == {"active": 2}


# -- racing planners ---------------------------------------------------------------------------


def test_two_planners_never_create_an_occurrence_twice(rig: Rig) -> None:
    other = Planner(rig.store, rig.settings, app=rig.app)
    for i in range(20):
        rig.client.schedules.add(f"s{i}", "t.tick", 7 + i)
    # One planner reads the due schedules; the other commits first.
    snapshot = rig.store.due_schedules(horizon=START + 60 * S, shard=0, shards=1, limit=100)
    first = other.plan_pass()
    real = rig.store.due_schedules

    def stale_read(**kwargs: Any) -> Any:
        return snapshot if kwargs.get("after") is None else real(**kwargs)

    rig.store.due_schedules = stale_read  # type: ignore[method-assign]
    second = rig.planner.plan_pass()
    rig.store.due_schedules = real  # type: ignore[method-assign]
    assert len(first.written) > 0 and second.written == []
    for step in range(1, 40):
        rig.clock.at(step * 3.3)
        (rig.planner if step % 2 else other).plan_pass()
        (other if step % 2 else rig.planner).plan_pass()
    keys = [job.key for job in rig.store._jobs.values()]
    assert len(keys) == len(set(keys))
    for i in range(20):
        every = 7 + i
        expected = list(range(every, int(39 * 3.3 + 60) + 1, every))
        assert rig.dues(f"s{i}") == expected


def test_a_pass_stops_at_its_budget() -> None:
    rig = make_rig(plan_batch_size=2)
    ticks = iter(range(100))
    rig.planner._clock = lambda: float(next(ticks))
    for i in range(5):
        rig.client.schedules.add(f"b{i}", "t.tick", 30)
    result = rig.planner.plan_pass(budget=0.5)
    assert result.more and result.schedules == 2
    result = rig.planner.plan_pass()
    assert not result.more and result.schedules == 3


def _store_corrupt(rig: Rig, name: str, **changes: Any) -> None:
    """Add a valid schedule ``name``, then change its stored row behind the
    API's back (what an older version, a bug or a hand edit could leave)."""
    rig.client.schedules.add(name, "t.tick", 10)
    row = rig.store.get_schedule(name)
    assert row is not None
    rig.store._schedules[name] = dataclasses.replace(row, **changes)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        # The OverflowError of issue 13, raised while computing the occurrence's
        # expires_at: 3e11 s (9,500 years) past 2026 is past datetime.max, and
        # 1e300 s is past what a timedelta holds.
        ({"options": {"expires": 3e11}}, "expires"),
        ({"options": {"expires": 1e300}}, "expires"),
        ({"timezone": "Mars/Olympus"}, "Mars/Olympus"),
        ({"spec": {"seconds": "often"}}, "often"),
        ({"kind": "lunar"}, "lunar"),
        ({"options": {"max_attempts": "many"}}, "many"),
    ],
)
def test_an_unplannable_schedule_is_marked_broken_and_the_others_fire(
    changes: dict[str, Any], reason: str
) -> None:
    rig = make_rig()  # the bad one sits in one batch between two good ones
    rig.client.schedules.add("a-good", "t.tick", 10)
    _store_corrupt(rig, "b-bad", **changes)
    rig.client.schedules.add("c-good", "t.tick", 10)
    result = rig.plan()
    assert result.broken == 1 and result.schedules == 3
    assert rig.dues("a-good") == rig.dues("c-good") == [10, 20, 30, 40, 50, 60]
    assert rig.dues("b-bad") == []
    row = rig.store.get_schedule("b-bad")
    assert row is not None and row.broken_at == START
    assert row.broken_reason is not None and reason in row.broken_reason
    assert row.next_nominal_at == START + 10 * S  # the cursor is kept for a retry
    info = rig.client.schedules.get("b-bad")
    assert info is not None and info.state == "broken" and info.next_run_at is None
    assert info.broken_reason == row.broken_reason and info.broken_at == START
    assert rig.client.schedules.counts() == {"active": 2, "broken": 1}
    rig.clock.at(30)
    again = rig.plan()  # a broken schedule is no longer read, nor marked again
    assert again.schedules == 2 and again.broken == 0
    assert rig.planner.stats.broken == 1


def test_the_overflowing_expires_of_the_issue(rig: Rig) -> None:
    rig.client.schedules.add("fine", "t.tick", 10)
    _store_corrupt(rig, "far", options={"expires": 3e11})
    rig.plan()
    row = rig.store.get_schedule("far")
    assert row is not None and row.broken_reason is not None
    assert row.broken_reason.startswith("InvalidSchedule: schedule 'far': expires 3e+11")
    assert "latest date" in row.broken_reason
    assert len(rig.dues("fine")) == 6


def test_a_user_change_clears_the_broken_mark(rig: Rig) -> None:
    _store_corrupt(rig, "bad", options={"expires": 3e11})
    rig.plan()
    assert rig.client.schedules.get("bad").state == "broken"  # type: ignore[union-attr]
    # Paused, it shows as paused (and keeps its reason); resuming retries it.
    assert rig.client.schedules.pause("bad").state == "paused"
    row = rig.store.get_schedule("bad")
    assert row is not None and row.broken_at is not None
    rig.plan()
    resumed = rig.client.schedules.resume("bad")
    assert resumed.state == "active" and resumed.broken_reason is None
    rig.plan()  # still unplannable: broken again
    assert rig.client.schedules.get("bad").state == "broken"  # type: ignore[union-attr]
    # resume also retries a broken schedule that was never paused
    assert rig.client.schedules.resume("bad").state == "active"
    rig.plan()
    fixed = rig.client.schedules.update("bad", expires=60)
    assert fixed.state == "active" and fixed.broken_at is None
    rig.plan()
    assert rig.dues("bad") == [10, 20, 30, 40, 50, 60]
    job = rig.store.get("bad@2026-03-02T12:00:10Z")
    # expires counts from the send (as stock beat counts it): kept as seconds
    assert job is not None and job.expires_at is None and job.options["expires"] == 60


def test_a_concurrent_fix_wins_over_marking_broken(rig: Rig) -> None:
    _store_corrupt(rig, "bad", options={"expires": 3e11})
    stale = rig.store.get_schedule("bad")
    assert stale is not None
    rig.client.schedules.update("bad", expires=60)  # the user's fix lands first
    assert not rig.store.mark_schedule_broken(stale.id, version=stale.version, reason="old")
    row = rig.store.get_schedule("bad")
    assert row is not None and row.broken_at is None and row.broken_reason is None


def test_a_broken_reason_is_one_storable_line() -> None:
    reason = broken_reason(ValueError("bad\x00name \udc80\n  line two " + "x" * 1000))
    assert reason.startswith("ValueError: bad\\x00name \\udc80 line two x")
    assert "\x00" not in reason and "\n" not in reason and len(reason) == 500
    reason.encode("utf-8")  # no lone surrogate left


def test_an_invalid_stored_definition_is_broken_not_finished(rig: Rig) -> None:
    _store_corrupt(rig, "bad", timezone="Mars/Olympus")
    rig.plan()
    info = rig.client.schedules.get("bad")
    assert info is not None and info.state == "broken"
    assert info.broken_reason is not None and "Mars/Olympus" in info.broken_reason
    assert rig.plan().schedules == 0


# -- the static sync ------------------------------------------------------------------------------


def test_static_sync_disables_removed_entries_and_keeps_dynamic_ones(rig: Rig) -> None:
    rig.app.conf.beat_schedule = {
        "kept": {"task": "t.tick", "schedule": 10.0},
        "removed": {"task": "t.tick", "schedule": crontab(minute="*")},
    }
    static = schedules.specs_from_app(rig.app)
    first = Planner(rig.store, rig.settings, app=rig.app, static=static).sync_static()
    assert first.added == 2
    rig.client.schedules.add("dynamic", "t.tick", 10)
    rig.plan()
    rig.clock.at(30)
    rig.app.conf.beat_schedule = {"kept": {"task": "t.tick", "schedule": 10.0}}
    again = Planner(
        rig.store, rig.settings, app=rig.app, static=schedules.specs_from_app(rig.app)
    ).sync_static()
    assert (again.added, again.updated, again.disabled, again.unchanged) == (0, 0, 1, 1)
    states = {i.name: (i.state, i.source) for i in rig.client.schedules.list()}
    assert states == {
        "dynamic": ("active", "dynamic"),
        "kept": ("active", "static"),
        "removed": ("disabled", "static"),
    }
    assert rig.dues("removed") == []  # 60 s: withdrawn, never due
    assert rig.dues("kept") == [10, 20, 30, 40, 50, 60]  # untouched by the sync
    with pytest.raises(InvalidSchedule, match="defined in code"):
        rig.client.schedules.update("kept", schedule=5)
    with pytest.raises(InvalidSchedule, match="defined in code"):
        rig.client.schedules.delete("kept")
    assert rig.client.schedules.pause("kept").state == "paused"
    assert rig.client.schedules.delete("removed") is True  # gone from the code: may go


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"schedule": crontab(minute="*")}, None, ""),
        ({"schedule": "61 * * * *"}, InvalidSchedule, "minute"),
        ({"schedule": 0}, InvalidSchedule, "positive"),
        ({"schedule": -5.0}, InvalidSchedule, "positive"),
        ({"schedule": 10, "timezone": "Mars/Olympus"}, UnknownTimezone, "Mars/Olympus"),
        ({"schedule": 10, "misfire": "sometimes"}, InvalidSchedule, "sometimes"),
        ({"schedule": 10, "overlap": "never"}, InvalidSchedule, "never"),
        ({"schedule": 10, "flavour": "mint"}, InvalidSchedule, "flavour"),
        ({"schedule": 10, "task": "t.unknown"}, InvalidSchedule, "t.unknown"),
        ({"schedule": 10, "args": (object(),)}, InvalidSchedule, "serialized"),
    ],
)
def test_bad_input_writes_nothing(
    rig: Rig, kwargs: dict[str, Any], error: type[Exception] | None, message: str
) -> None:
    values = {"task": "t.tick", **kwargs}
    if error is None:
        rig.client.schedules.add("ok", **values)
        assert rig.client.schedules.get("ok") is not None
        return
    with pytest.raises(error, match=message):
        rig.client.schedules.add("bad", **values)
    assert rig.store.list_schedules() == []


def test_taken_name_and_bad_updates_write_nothing(rig: Rig) -> None:
    rig.client.schedules.add("x", "t.tick", 10)
    with pytest.raises(ScheduleExists, match="'x'"):
        rig.client.schedules.add("x", "t.tick", 20)
    before = rig.store.get_schedule("x")
    with pytest.raises(InvalidSchedule):
        rig.client.schedules.update("x", schedule="* * *")
    with pytest.raises(UnknownTimezone):
        rig.client.schedules.update("x", timezone="Nowhere/Land")
    assert rig.store.get_schedule("x") == before
    with pytest.raises(UnknownSchedule):
        rig.client.schedules.update("nope", schedule=5)
    with pytest.raises(UnknownSchedule):
        rig.client.schedules.pause("nope")
    with pytest.raises(InvalidSchedule, match="entry 1"):
        rig.client.schedules.add_many(
            [
                {"name": "y", "task": "t.tick", "schedule": 10},
                {"name": "z", "task": "t.tick", "schedule": 0},
            ]
        )
    assert [s.name for s in rig.store.list_schedules()] == ["x"]


# -- helpers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule",
    [10, crontab(minute="*/15"), crontab(minute="30", hour="2"), schedules.clocked(START + 90 * S)],
)
def test_cursor_before_leads_back_to_the_instant(rig: Rig, schedule: Any) -> None:
    spec = schedules.make_spec("c", "t.tick", schedule, app=rig.app, timezone="America/New_York")
    instant = first_nominal(spec, START)
    assert instant is not None
    assert schedules.next_after(spec, cursor_before(spec, instant)) == instant


# -- the leader loop -------------------------------------------------------------------------


def test_engine_syncs_plans_and_publishes_occurrences_on_time() -> None:
    from celery_sched.dispatch.memory import MemoryDispatcher
    from celery_sched.leader import Engine
    from celery_sched.lease.memory import MemoryLeaseBackend
    from tests.unit.test_engine import Clock as LoopClock
    from tests.unit.test_engine import FlakyStaging, FlakyStore
    from tests.unit.test_engine import Rig as LoopRig

    clock = LoopClock()
    settings = Settings(
        lease_ttl=3.0,
        lease_safety_margin=0.3,
        sweep_interval=5.0,
        staging_window=20.0,
        plan_horizon=30.0,
    )
    loop = LoopRig(
        clock=clock,
        store=FlakyStore(clock=clock.wall),
        staging=FlakyStaging(),
        dispatcher=MemoryDispatcher(),
        lease=MemoryLeaseBackend(clock=clock.mono),
        settings=settings,
    )
    app = Celery("loop-tests", set_as_current=False)
    app.task(name="t.tick")(_tick)
    app.conf.beat_schedule = {"every2": {"task": "t.tick", "schedule": 2.0, "args": (1,)}}
    planner = Planner(loop.store, settings, app=app, static=schedules.specs_from_app(app))
    elector = loop.elector("a")
    assert elector.try_acquire() is not None
    engine = Engine(
        store=loop.store,
        staging=loop.staging,
        dispatcher=loop.dispatcher,
        elector=elector,
        settings=settings,
        clock=clock.mono,
        wall=clock.wall,
        planner=planner,
    )
    loop.run(engine, 41, step=0.05)
    assert planner.stats.syncs == 1
    sent = [loop.store.get_by_id(job_id) for job_id in loop.dispatcher.sent_ids()]
    assert len(sent) == 20
    dues = [job.due_at for job in sent if job is not None]
    assert [(b - a).total_seconds() for a, b in itertools.pairwise(dues)] == [2.0] * 19
    lags = [
        (job.dispatched_at - job.due_at).total_seconds()
        for job in sent
        if job and job.dispatched_at
    ]
    assert max(lags) <= 0.1, lags
    assert engine.stats.planned >= 20
