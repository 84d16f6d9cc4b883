"""Custom schedule classes (#15, point 3): instants compared with a simulated
stock beat loop, one unhandleable entry never stops the others, and the
planner evaluates the code's object, not the stored row."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import BaseSchedule, schedule

from celery_sched import schedules
from celery_sched.client import Client
from celery_sched.errors import InvalidSchedule
from celery_sched.leader.planning import Planner
from celery_sched.models import ScheduleSpec
from celery_sched.settings import Settings
from celery_sched.store.memory import MemoryJobStore

START = dt.datetime(2026, 3, 2, 12, 0, tzinfo=dt.UTC)  # a whole, even minute
S = dt.timedelta(seconds=1)


class EveryNOnEvenMinutes(BaseSchedule):
    """Due ``seconds`` after the last run, but only within an even minute of
    the app's wall clock; written only through ``is_due`` and
    ``remaining_estimate``, as a user would."""

    def __init__(self, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return last_run_at + dt.timedelta(seconds=self.seconds) - self.now()

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:  # type: ignore[override]
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        if remaining > 0:
            return False, remaining
        now = self.now()
        if now.minute % 2 == 0:
            return True, float(self.seconds)
        to_even = 60 - now.second - now.microsecond / 1e6
        return False, to_even


class Flaky(BaseSchedule):
    """Every 30 s, until told to fail (shared state: the planner's copy sees it)."""

    def __init__(self, state: dict[str, bool], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state = state

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return last_run_at + 30 * S - self.now()

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:  # type: ignore[override]
        if self.state["fail"]:
            raise ZeroDivisionError("the user's bug")
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        return (True, 30.0) if remaining <= 0 else (False, remaining)


class NeverDue(BaseSchedule):
    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return dt.timedelta(hours=1)

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:  # type: ignore[override]
        return False, 3600.0


class Duck:
    """Not a BaseSchedule: ``is_due``, ``remaining_estimate`` and ``now``."""

    def now(self) -> dt.datetime:
        return dt.datetime.now(dt.UTC)

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return last_run_at + 90 * S - self.now()

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        return (True, 90.0) if remaining <= 0 else (False, remaining)


class ClocklessDuck:
    """Reads the real time itself: nothing the planner could drive."""

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:
        return dt.datetime.now(dt.UTC) - last_run_at >= 60 * S, 60.0

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return 60 * S


class OddSecondsInterval(schedule):
    """A subclass of Celery's interval schedule that decides by itself."""

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:  # type: ignore[override]
        due, wait = super().is_due(last_run_at)
        return due and self.now().second % 2 == 1, 1.0 if due else wait


def _tick(*args: Any, **kwargs: Any) -> None:
    """The task every test schedules."""


def make_app(zone: str = "UTC") -> Celery:
    app = Celery("custom-tests", set_as_current=False)
    app.conf.timezone = zone
    app.task(name="t.tick")(_tick)
    return app


def beat_instants(app: Celery, obj: BaseSchedule, start: dt.datetime, count: int) -> list[Any]:
    """What stock beat's loop runs ``obj`` at, on a fake clock: it asks
    ``ScheduleEntry.is_due`` (``last_run_at`` = the start, then the time of
    each run, ``entry.next()``) and checks again after the answer's wait, as
    ``Scheduler.tick`` reschedules the entry."""
    clock = [start]
    obj.nowfun = lambda: clock[0].astimezone(app.timezone)
    entry = ScheduleEntry(name="e", task="t.tick", schedule=obj, app=app)
    assert entry.last_run_at == start  # default_now() reads the fake clock
    runs: list[Any] = []
    for _ in range(100_000):
        due, wait = entry.is_due()
        if due:
            runs.append(clock[0])
            if len(runs) == count:
                return runs
            entry = entry.next()
        clock[0] += dt.timedelta(seconds=wait)
    raise AssertionError("beat never ran it")


def adapter_instants(spec: ScheduleSpec, start: dt.datetime, count: int) -> list[Any]:
    instants = [schedules.first_after(spec, start)]
    while len(instants) < count:
        previous = instants[-1]
        assert previous is not None
        instants.append(schedules.next_after(spec, previous))
    return instants


def static_spec(app: Celery, name: str, obj: object, **fields: Any) -> ScheduleSpec:
    return schedules.make_spec(name, "t.tick", obj, app=app, source="static", **fields)


# -- the adapter against stock beat's loop ---------------------------------------------


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kathmandu"])  # +05:45 flips minute parity
@pytest.mark.parametrize("seconds", [45, 20, 150])
def test_instants_are_those_stock_beat_runs(zone: str, seconds: float) -> None:
    app = make_app(zone)
    spec = static_spec(app, "even", EveryNOnEvenMinutes(seconds, app=app))
    assert spec.kind == "custom" and spec.timezone == zone
    expected = beat_instants(app, EveryNOnEvenMinutes(seconds, app=app), START, 40)
    got = adapter_instants(spec, START, 40)
    assert got == [moment.astimezone(dt.UTC) for moment in expected]
    # Not a plain interval: the odd minutes are left out.
    assert all(moment.astimezone(app.timezone).minute % 2 == 0 for moment in got)
    assert len({moment.tzinfo for moment in got}) == 1 and got[0].utcoffset() == dt.timedelta(0)


def test_a_celery_schedule_subclass_that_decides_by_itself_is_custom() -> None:
    app = make_app()
    spec = static_spec(app, "odd", OddSecondsInterval(run_every=10, app=app))
    assert spec.kind == "custom"
    expected = beat_instants(app, OddSecondsInterval(run_every=10, app=app), START, 10)
    assert adapter_instants(spec, START, 10) == expected
    # An unchanged subclass stays a stored interval.
    plain = static_spec(app, "plain", type("Plain", (schedule,), {})(run_every=10, app=app))
    assert plain.kind == "interval"


def test_a_duck_typed_schedule_with_now_is_driven_by_the_planners_clock() -> None:
    app = make_app()
    spec = static_spec(app, "duck", Duck())
    got = adapter_instants(spec, START, 3)
    assert got == [START + 90 * S, START + 180 * S, START + 270 * S]


def test_the_stored_definition_names_the_class_without_an_address() -> None:
    app = make_app()
    spec = static_spec(app, "never-mind", EveryNOnEvenMinutes(45, app=app))
    stored = dict(spec.spec)
    assert stored["class"] == f"{__name__}.EveryNOnEvenMinutes"
    assert "EveryNOnEvenMinutes" in stored["repr"] and " at 0x" not in stored["repr"]
    assert set(stored) == {"class", "repr"}


def test_an_object_never_due_is_refused_not_looped_on() -> None:
    app = make_app()
    with pytest.raises(InvalidSchedule, match=r"'sleepy'.*not due within 10000 checks"):
        static_spec(app, "sleepy", NeverDue(app=app))


def test_an_object_without_a_clock_to_drive_is_refused() -> None:
    with pytest.raises(InvalidSchedule, match=r"'real-time'.*neither nowfun nor now\(\)"):
        static_spec(make_app(), "real-time", ClocklessDuck())


def test_a_stored_custom_row_does_not_evaluate_without_the_object() -> None:
    app = make_app()
    spec = static_spec(app, "even", EveryNOnEvenMinutes(45, app=app))
    from_store = ScheduleSpec(
        name="even", task="t.tick", kind="custom", spec=dict(spec.spec), source="static"
    )
    with pytest.raises(InvalidSchedule, match=r"'even'.*evaluated from the object in the code"):
        schedules.next_after(from_store, START)


def test_the_client_refuses_a_custom_schedule() -> None:
    app = make_app()
    store = MemoryJobStore(clock=lambda: START)
    client = Client(app, settings=Settings(), store=store, staging=False)
    with pytest.raises(
        InvalidSchedule,
        match=r"'api'.*custom schedule class .*EveryNOnEvenMinutes.* works only in "
        r"app\.conf\.beat_schedule or the task decorator",
    ):
        client.schedules.add("api", "t.tick", EveryNOnEvenMinutes(45, app=app))
    assert client.schedules.list() == []


# -- one bad entry never stops the others -----------------------------------------------


def _app_with_mixed_entries() -> tuple[Celery, dict[str, bool]]:
    app = make_app()
    failing = {"fail": True}
    app.conf.beat_schedule = {
        "even": {"task": "t.tick", "schedule": EveryNOnEvenMinutes(45, app=app)},
        "raising": {"task": "t.tick", "schedule": Flaky(failing, app=app)},
        "every10": {"task": "t.tick", "schedule": 10.0},
    }
    return app, failing


def test_specs_from_app_logs_and_leaves_out_an_entry_it_cannot_handle(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, _ = _app_with_mixed_entries()
    with pytest.raises(InvalidSchedule, match=r"'raising'.*ZeroDivisionError: the user's bug"):
        schedules.specs_from_app(app)
    with caplog.at_level(logging.ERROR, logger="celery_sched.schedules.spec"):
        specs = schedules.specs_from_app(app, skip_invalid=True)
    assert [(spec.name, spec.kind) for spec in specs] == [
        ("even", "custom"),
        ("every10", "interval"),
    ]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "beat_schedule entry 'raising'" in errors[0] and "ZeroDivisionError" in errors[0]


def test_beat_starts_with_the_entries_it_can_handle(caplog: pytest.LogCaptureFixture) -> None:
    from celery_sched.beat import Scheduler

    app, _ = _app_with_mixed_entries()
    app.conf.result_expires = None  # no backend_cleanup entry
    with caplog.at_level(logging.ERROR):
        specs = Scheduler(app, lazy=True)._static_specs()
    assert [spec.name for spec in specs] == ["even", "every10"]
    assert any("'raising'" in r.getMessage() for r in caplog.records)


def make_planner(app: Celery, clock: list[dt.datetime], static: list[ScheduleSpec]) -> Planner:
    config = Settings(plan_horizon=300.0, misfire_grace=1.0)
    store = MemoryJobStore(clock=lambda: clock[0])
    return Planner(store, config, app=app, static=static)


def dues(planner: Planner, name: str) -> list[dt.datetime]:
    store: Any = planner.store
    return sorted(job.due_at for job in store._jobs.values() if job.key.startswith(name + "@"))


def test_the_planner_plans_custom_and_plain_schedules_side_by_side() -> None:
    app, failing = _app_with_mixed_entries()
    failing["fail"] = False  # all three load; "raising" breaks later
    clock = [START]
    planner = make_planner(app, clock, schedules.specs_from_app(app))
    synced = planner.sync_static()
    assert synced.added == 3
    row = planner.store.get_schedule("even")
    assert row is not None and row.kind == "custom" and row.source == "static"
    assert row.spec == {"class": f"{__name__}.EveryNOnEvenMinutes", "repr": row.spec["repr"]}

    failing["fail"] = True
    result = planner.plan_pass()
    assert result.broken == 1 and result.absent == 0
    broken = planner.store.get_schedule("raising")
    assert broken is not None and broken.broken_reason is not None
    assert "ZeroDivisionError" in broken.broken_reason
    expected = beat_instants(app, EveryNOnEvenMinutes(45, app=app), START, 10)
    planned = dues(planner, "even")
    assert planned == [t for t in expected if t <= START + 300 * S] and len(planned) == 5
    assert dues(planner, "every10") == [START + n * 10 * S for n in range(1, 31)]

    clock[0] = START + 200 * S  # the next pass goes on from the cursor
    planner.plan_pass()
    assert dues(planner, "even") == [t for t in expected if t <= START + 500 * S]


def test_a_custom_row_without_its_object_is_left_alone_and_the_others_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make_app()
    clock = [START]
    even = static_spec(app, "even", EveryNOnEvenMinutes(45, app=app))
    every10 = static_spec(app, "every10", 10.0)
    planner = make_planner(app, clock, [even, every10])
    planner.sync_static()
    # Another beat (older code) leads now: it has every10 but not "even".
    other = Planner(planner.store, planner.settings, app=app, static=[every10])
    with caplog.at_level(logging.ERROR, logger="celery_sched.leader.planning"):
        first = other.plan_pass()
        clock[0] = START + 100 * S
        second = other.plan_pass()
    assert (first.absent, first.broken, second.absent) == (1, 0, 1)
    assert dues(other, "even") == [] and len(dues(other, "every10")) == 40
    row = other.store.get_schedule("even")
    assert row is not None and row.broken_at is None  # not set aside: self-healing
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 1 and "'even'" in logged[0] and "no beat_schedule entry" in logged[0]
    # The first leader whose code has the object plans it, nobody resumes it.
    planner.plan_pass()
    assert dues(planner, "even")[0] == START + 145 * S


def test_a_static_schedule_failing_at_sync_does_not_keep_the_others_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, failing = _app_with_mixed_entries()
    failing["fail"] = False
    clock = [START]
    planner = make_planner(app, clock, schedules.specs_from_app(app))
    failing["fail"] = True
    with caplog.at_level(logging.ERROR, logger="celery_sched.leader.planning"):
        synced = planner.sync_static()
    assert synced.added == 2
    assert planner.store.get_schedule("raising") is None
    assert planner.store.get_schedule("even") is not None
    assert any("'raising'" in r.getMessage() for r in caplog.records)
