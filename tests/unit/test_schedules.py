"""The pure schedule module: specs from every source, evaluation, misfire planning.

No services: a real ``Celery("t")`` app object (never connected) and
instants passed in as the clock.
"""

from __future__ import annotations

import datetime as dt
import math
import pickle
import time
import zoneinfo
from typing import Any

import pytest
from celery import Celery, Task
from celery.schedules import crontab, schedule, solar
from celery.utils.time import remaining
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_sched.errors import (
    AmbiguousTime,
    CelerySchedError,
    InvalidSchedule,
    NonExistentTime,
    UnknownTimezone,
)
from celery_sched.models import SCHEDULE_KINDS, MisfirePolicy, OverlapPolicy, ScheduleSpec
from celery_sched.schedules import (
    ENTRY_KEYS,
    Plan,
    clocked,
    first_after,
    make_spec,
    next_after,
    occurrence_key,
    plan,
    schedule_from_spec,
    spec_from_entry,
    specs_from_app,
)
from celery_sched.schedules.cron import CronString, cron_from_string
from celery_sched.store.schema import SCHEDULE_KINDS as TABLE_KINDS

UTC = dt.UTC
T0 = dt.datetime(2024, 1, 1, tzinfo=UTC)
S = dt.timedelta(seconds=1)
MIN = dt.timedelta(minutes=1)
HOUR = dt.timedelta(hours=1)
DAY = dt.timedelta(days=1)


@pytest.fixture
def app() -> Celery:
    return Celery("t")


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


def interval(app: Celery, seconds: float, **kw: Any) -> ScheduleSpec:
    return make_spec("every", "tasks.tick", seconds, app=app, **kw)


def planned(spec: ScheduleSpec, **kw: Any) -> Plan:
    defaults: dict[str, Any] = {
        "default_misfire": MisfirePolicy.ONCE,
        "catchup_window": 3600.0,
        "max_catchup": 100,
        "grace": 1.0,
    }
    defaults.update(kw)
    return plan(spec, **defaults)


def enumerate_between(
    spec: ScheduleSpec, after: dt.datetime, before: dt.datetime
) -> list[dt.datetime]:
    """Every occurrence strictly between ``after`` and ``before``, one by one."""
    out: list[dt.datetime] = []
    moment = next_after(spec, after)
    while moment is not None and moment < before:
        out.append(moment)
        moment = next_after(spec, moment)
    return out


# -- keys and models -------------------------------------------------------------------


def test_occurrence_key_is_name_at_utc_iso() -> None:
    assert occurrence_key("report", at("2026-03-08 07:00")) == "report@2026-03-08T07:00:00Z"
    with_us = at("2026-03-08 07:00:00.000250")
    assert occurrence_key("report", with_us) == "report@2026-03-08T07:00:00.000250Z"
    berlin = dt.datetime(2026, 3, 8, 8, 0, tzinfo=zoneinfo.ZoneInfo("Europe/Berlin"))
    assert occurrence_key("r", berlin) == "r@2026-03-08T07:00:00Z"
    with pytest.raises(ValueError, match="timezone-aware"):
        occurrence_key("r", dt.datetime(2026, 3, 8, 7))


def test_schedule_kinds_match_the_table_constraint() -> None:
    assert frozenset(TABLE_KINDS) == SCHEDULE_KINDS


def test_schedule_spec_checks_its_fields() -> None:
    base: dict[str, Any] = {"name": "n", "task": "t", "kind": "interval", "spec": {"seconds": 5}}
    spec = ScheduleSpec(**base, misfire="all", overlap="skip", args=[1, 2])  # type: ignore[arg-type]
    assert spec.misfire is MisfirePolicy.ALL and spec.overlap is OverlapPolicy.SKIP
    assert spec.args == (1, 2)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"name": ""}, "name"),
        ({"task": ""}, "task"),
        ({"kind": "weekly"}, "unknown schedule kind 'weekly'"),
        ({"misfire": "sometimes"}, "unknown misfire policy 'sometimes'"),
        ({"overlap": "queue"}, "unknown overlap policy 'queue'"),
        ({"catchup_window": -1}, "catchup_window"),
        ({"catchup_window": math.nan}, "catchup_window"),
        ({"max_catchup": True}, "max_catchup"),
        ({"max_catchup": -1}, "max_catchup"),
        ({"source": "yaml"}, "source"),
        ({"spec": [1]}, "spec must be a mapping"),
    ]
    for change, message in bad:
        with pytest.raises(InvalidSchedule, match=message):
            ScheduleSpec(**{**base, **change})
    with pytest.raises(UnknownTimezone, match="Mars/Olympus"):
        ScheduleSpec(**base, timezone="Mars/Olympus")


# -- make_spec: every kind of schedule ----------------------------------------------------


def test_crontab_fields_and_the_apps_timezone(app: Celery) -> None:
    app.conf.timezone = "Europe/Berlin"
    spec = make_spec(
        "c", "tasks.c", crontab(minute="*/15", hour="8-17", day_of_week="mon-fri"), app=app
    )
    assert spec.kind == "crontab"
    assert spec.timezone == "Europe/Berlin"
    assert dict(spec.spec) == {
        "minute": "*/15",
        "hour": "8-17",
        "day_of_week": "mon-fri",
        "day_of_month": "*",
        "month_of_year": "*",
    }
    assert spec.source == "dynamic" and spec.enabled and spec.misfire is None
    # Mon 1 Jan 2024 07:59 UTC is 08:59 in Berlin.
    assert next_after(spec, at("2024-01-01 07:59")) == at("2024-01-01 08:00")


def test_crontab_given_as_numbers_and_lists_becomes_cron_text(app: Celery) -> None:
    spec = make_spec("c", "t", crontab(minute=0, hour=[13, 1], day_of_week=set(range(7))), app=app)
    assert spec.spec["minute"] == "0"
    assert spec.spec["hour"] == "1,13"
    assert spec.spec["day_of_week"] == "*"


def test_timezone_precedence(app: Celery) -> None:
    app.conf.timezone = "Europe/Berlin"
    own = crontab(minute="0")
    own.tz = zoneinfo.ZoneInfo("Asia/Tokyo")  # type: ignore[assignment]  # e.g. TzAwareCrontab
    assert make_spec("c", "t", own, app=app).timezone == "Asia/Tokyo"
    assert make_spec("c", "t", own, app=app, timezone="America/New_York").timezone == (
        "America/New_York"
    )
    zone = zoneinfo.ZoneInfo("Australia/Lord_Howe")
    assert (
        make_spec("c", "t", "0 * * * *", app=app, timezone=zone).timezone == "Australia/Lord_Howe"
    )
    assert make_spec("c", "t", "0 * * * *", app=Celery("plain")).timezone == "UTC"


def test_cron_strings_and_macros(app: Celery) -> None:
    spec = make_spec("c", "t", "*/5 1,2 31 1-3 *", app=app)
    assert dict(spec.spec) == {
        "minute": "*/5",
        "hour": "1,2",
        "day_of_week": "*",
        "day_of_month": "31",
        "month_of_year": "1-3",
    }
    daily = make_spec("d", "t", "@daily", app=app)
    assert (daily.spec["minute"], daily.spec["hour"]) == ("0", "0")
    assert next_after(daily, at("2024-05-05 10:00")) == at("2024-05-06 00:00")
    with pytest.raises(InvalidSchedule, match="5 fields"):
        make_spec("c", "t", "*/5 * * *", app=app)


def test_cron_string_extensions_are_stored_as_cron_text(app: Celery) -> None:
    def stored(text: str) -> dict[str, Any]:
        return dict(make_spec("c", "t", text, app=app).spec)

    # What Celery's crontab can say is stored in its syntax; L, LW, nL and n#k as cron tokens.
    assert stored("5/15 3/6 L * 7") == {
        "minute": "5,20,35,50",
        "hour": "3,9,15,21",
        "day_of_week": "0",
        "day_of_month": "L",
        "month_of_year": "*",
    }
    assert stored("0 9 1,lw * 5-7")["day_of_month"] == "1,LW"
    assert stored("0 9 1,lw * 5-7")["day_of_week"] == "0,5,6"
    assert stored("0 9 * * 5L,7l")["day_of_week"] == "5L,0L"
    # Celery's parser reads mon#2 and mon/2 as every Monday; a cron string means cron.
    assert stored("0 9 * * mon#2")["day_of_week"] == "1#2"
    assert stored("0 9 * * mon/2")["day_of_week"] == "0,1,3,5"
    assert stored("0 9 * * mon-fri")["day_of_week"] == "mon-fri"  # as before
    # A crontab object keeps Celery's reading, stored and evaluated as before.
    legacy = make_spec("c", "t", crontab(minute="0", hour="9", day_of_week="mon#2"), app=app)
    assert legacy.spec["day_of_week"] == "mon#2"
    assert next_after(legacy, at("2024-01-01 10:00")) == at("2024-01-08 09:00")  # a Monday
    assert next_after(legacy, at("2024-01-08 10:00")) == at("2024-01-15 09:00")  # and the next


@pytest.mark.parametrize(
    ("text", "after", "expected"),
    [
        ("0 9 L 2 *", "2023-01-01", ["2023-02-28 09:00", "2024-02-29 09:00", "2025-02-28 09:00"]),
        # 31 Aug 2024 is a Saturday, 30 Nov a Saturday, 30 Sep a Monday.
        (
            "0 9 LW 8-11 *",
            "2024-08-01",
            ["2024-08-30 09:00", "2024-09-30 09:00", "2024-10-31 09:00"],
        ),
        ("0 9 * * 5L", "2024-01-01", ["2024-01-26 09:00", "2024-02-23 09:00", "2024-03-29 09:00"]),
        ("0 9 * * 1#2", "2024-01-01", ["2024-01-08 09:00", "2024-02-12 09:00", "2024-03-11 09:00"]),
        ("0 9 * * 1#5", "2024-01-01", ["2024-01-29 09:00", "2024-04-29 09:00", "2024-07-29 09:00"]),
        # ANDed: the last day of the month when it is a Friday.
        ("0 9 L * 5", "2024-01-01", ["2024-05-31 09:00", "2025-01-31 09:00", "2025-02-28 09:00"]),
        (
            "5/20 9 * * 7",
            "2024-01-01",
            ["2024-01-07 09:05", "2024-01-07 09:25", "2024-01-07 09:45"],
        ),
    ],
)
def test_cron_string_extensions_fire_with_crons_meaning(
    app: Celery, text: str, after: str, expected: list[str]
) -> None:
    spec = make_spec("c", "t", text, app=app)
    got = enumerate_between(spec, at(after), at(expected[-1]) + S)
    assert got == [at(moment) for moment in expected]
    # The same text read from a stored spec (Celery's syntax where it has one) agrees.
    parts = text.split()
    fields = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    written = dict(zip(fields, parts, strict=True))
    raw = ScheduleSpec(name="raw", task="t", kind="crontab", spec=written)
    assert enumerate_between(raw, at(after), at(expected[-1]) + S) == got


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0 0 * * 32L", "day_of_week='32L': 32 is out of range 0-7"),
        ("0 0 32L * *", r"day_of_month='32L': .*takes L \(last day\) or LW"),
        ("0 0 15W * *", r"day_of_month='15W': .*takes L \(last day\) or LW"),
        ("0 0 * * 8#1", "day_of_week='8#1': 8 is out of range 0-7"),
        ("0 0 * * 1#6", "day_of_week='1#6': .*must be 1 to 5"),
        ("0 0 * * mon#2x", "day_of_week='mon#2x': .*must be 1 to 5"),
        ("0 0 * * L", "day_of_week='L': .*needs a weekday before it"),
        ("0 0 * * LW", "day_of_week='LW': .*W goes in day_of_month only"),
        ("L * * * *", "minute='L': .*go in the day fields only"),
        ("0 L * * *", "hour='L': .*go in the day fields only"),
        ("0 0 1#2 * *", "day_of_month='1#2': .*go in the day fields only"),
        ("5/0 * * * *", "minute='5/0': step '0' must be a whole number of at least 1"),
        ("0 0 * * funday", "day_of_week='funday': 'funday' is not a number or a weekday name"),
        ("0 0 1-7 * 1#5", "never fires: .*day_of_month='1-7' and day_of_week='1#5'"),
    ],
)
def test_invalid_cron_string_forms_are_named(app: Celery, text: str, message: str) -> None:
    with pytest.raises(InvalidSchedule, match=message):
        make_spec("bad", "t", text, app=app)


def test_cron_string_with_last_day_is_a_crontab_evaluated_by_our_rules(app: Celery) -> None:
    now = at("2024-02-10 12:00")
    cron = cron_from_string("c", "0 9 L * *")
    assert isinstance(cron, CronString)
    assert make_spec("c", "t", cron, app=app).spec["day_of_month"] == "L"
    bound = CronString("0", "9", "*", "L", "*", nowfun=lambda: now, app=app)
    assert bound.remaining_estimate(now) == at("2024-02-29 09:00") - now  # not the 28th
    assert pickle.loads(pickle.dumps(cron)) == cron
    assert cron != crontab("0", "9", "*", "28-31", "*")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(dt.timedelta(minutes=5), 300.0), (30, 30.0), (2.5, 2.5), (schedule(10), 10.0)],
)
def test_interval_forms(app: Celery, value: object, seconds: float) -> None:
    spec = make_spec("i", "t", value, app=app)
    assert spec.kind == "interval" and dict(spec.spec) == {"seconds": seconds}
    assert next_after(spec, T0) == T0 + dt.timedelta(seconds=seconds)
    assert spec.relative is False


def test_relative_comes_from_the_option_or_the_schedule_object(app: Celery) -> None:
    assert make_spec("i", "t", schedule(60, relative=True), app=app).relative is True
    assert make_spec("i", "t", 60, app=app, relative=True).relative is True


def test_solar_matches_celerys_own_solar(app: Celery) -> None:
    sunset = solar("sunset", 40.7128, -74.006)
    spec = make_spec("s", "t", sunset, app=app)
    assert spec.kind == "solar"
    assert dict(spec.spec) == {"event": "sunset", "lat": 40.7128, "lon": -74.006}
    for start in (at("2024-06-21 12:00"), at("2024-12-21 03:00"), at("2024-03-10 23:59")):
        ours = next_after(spec, start)
        assert ours is not None and ours > start
        reference = solar("sunset", 40.7128, -74.006, app=app, nowfun=lambda start=start: start)
        theirs = start + reference.remaining_estimate(start)
        assert abs(ours - theirs) <= S  # we round events to whole seconds
        again = next_after(spec, ours)
        assert again is not None and dt.timedelta(hours=23) < again - ours < dt.timedelta(hours=25)


def test_solar_event_that_does_not_happen_for_months(app: Celery) -> None:
    # Tromsø (69.6 N): no sunrise during the polar night, late Nov - mid Jan.
    spec = make_spec("s", "t", solar("sunrise", 69.65, 18.96), app=app)
    found = next_after(spec, at("2024-12-01 00:00"))
    assert found is not None and at("2025-01-10 00:00") < found < at("2025-01-25 00:00")


def test_clocked_forms(app: Celery) -> None:
    app.conf.timezone = "America/New_York"
    aware = make_spec("c", "t", clocked(at("2026-03-07 07:00")), app=app)
    assert aware.kind == "clocked" and dict(aware.spec) == {"at": "2026-03-07T07:00:00Z"}
    naive = make_spec("c", "t", clocked(dt.datetime(2026, 3, 7, 2, 0)), app=app)
    assert naive.spec["at"] == "2026-03-07T07:00:00Z"  # 02:00 EST
    text = make_spec("c", "t", clocked("2026-03-07T07:00:00Z"), app=app)
    assert text.spec == aware.spec
    other_zone = make_spec("c", "t", clocked(dt.datetime(2026, 3, 8, 2)), app=app, timezone="UTC")
    assert other_zone.spec["at"] == "2026-03-08T02:00:00Z"
    with pytest.raises(NonExistentTime):  # US clocks spring forward on 8 Mar 2026
        make_spec("c", "t", clocked(dt.datetime(2026, 3, 8, 2, 30)), app=app)
    with pytest.raises(AmbiguousTime):  # ...and fall back on 1 Nov 2026
        make_spec("c", "t", clocked(dt.datetime(2026, 11, 1, 1, 30)), app=app)
    with pytest.raises(InvalidSchedule, match="ISO 8601"):
        clocked("next tuesday")
    assert first_after(aware, at("2026-03-07 06:59")) == at("2026-03-07 07:00")
    assert next_after(aware, at("2026-03-07 07:00")) is None


def test_clocked_runs_once_under_stock_beat(app: Celery) -> None:
    when = at("2026-01-01 12:00")
    now = [when - MIN]
    one_off = clocked(when, app=app, nowfun=lambda: now[0])
    created = when - HOUR  # beat's first "last run" is its start time
    due, wait = one_off.is_due(created)
    assert not due and wait == pytest.approx(60.0)
    now[0] = when + S
    assert one_off.is_due(created)[0]
    assert not one_off.is_due(now[0])[0]  # it ran: never again
    plain = clocked(when)
    assert pickle.loads(pickle.dumps(plain)) == plain == one_off


# -- make_spec: bad input ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"minute": "61"}, "minute='61'"),
        ({"minute": "*/0"}, "minute='\\*/0'"),
        ({"minute": "-1"}, "minute='-1'"),
        ({"hour": "24"}, "hour='24'"),
        ({"day_of_week": "funday"}, "day_of_week='funday'"),
        ({"day_of_month": "32"}, "day_of_month='32'"),
        ({"month_of_year": "13"}, "month_of_year='13'"),
        ({"day_of_month": "30", "month_of_year": "2"}, "never fires"),
    ],
)
def test_invalid_crontab_fields_are_named(
    app: Celery, fields: dict[str, str], message: str
) -> None:
    text = " ".join(
        fields.get(name, "*")
        for name in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    )
    with pytest.raises(InvalidSchedule, match=message):
        make_spec("bad", "t", text, app=app)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "positive"),
        (-5, "positive"),
        (math.nan, "positive"),
        (math.inf, "positive"),
        (dt.timedelta(0), "positive"),
        (schedule(dt.timedelta(seconds=-1)), "positive"),
        (True, "unsupported schedule type bool"),
        (object(), "unsupported schedule type object"),
        ({"seconds": 5}, "unsupported schedule type dict"),
    ],
)
def test_bad_schedule_values(app: Celery, value: object, message: str) -> None:
    with pytest.raises(InvalidSchedule, match=message):
        make_spec("bad", "t", value, app=app)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"misfire": "sometimes"}, InvalidSchedule, "unknown misfire policy 'sometimes'"),
        ({"overlap": "queue"}, InvalidSchedule, "unknown overlap policy 'queue'"),
        ({"options": {"colour": "red"}}, InvalidSchedule, "colour"),
        ({"options": {"priority": 300}}, InvalidSchedule, "priority"),
        ({"options": {"queue": ""}}, InvalidSchedule, "queue"),
        ({"options": {"expires": T0}}, InvalidSchedule, "expires must be a number"),
        ({"options": {"expires": -1}}, InvalidSchedule, "expires"),
        ({"args": (object(),)}, InvalidSchedule, "cannot be serialized"),
        ({"args": "abc"}, InvalidSchedule, "args must be a list or tuple"),
        ({"kwargs": [1]}, InvalidSchedule, "kwargs must be a mapping"),
        ({"kwargs": {1: 2}}, InvalidSchedule, "string keys"),
        ({"timezone": "Mars/Olympus"}, UnknownTimezone, "Mars/Olympus"),
        ({"catchup_window": -3}, InvalidSchedule, "catchup_window"),
        ({"max_catchup": 1.5}, InvalidSchedule, "max_catchup"),
        ({"relative": "yes"}, InvalidSchedule, "relative must be a bool"),
    ],
)
def test_bad_options_and_policies(
    app: Celery, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message) as raised:
        make_spec("bad", "t", 60, app=app, **kwargs)
    assert isinstance(raised.value, CelerySchedError)
    assert "bad" in str(raised.value) or error is UnknownTimezone


def test_bad_names_and_tasks(app: Celery) -> None:
    for name in ("", "   ", None, 5, "x" * 600, "nul\x00"):
        with pytest.raises(InvalidSchedule, match="name"):
            make_spec(name, "t", 60, app=app)  # type: ignore[arg-type]
    with pytest.raises(InvalidSchedule, match="task"):
        make_spec("n", "", 60, app=app)


def test_good_options_are_kept(app: Celery) -> None:
    options = {"queue": "reports", "priority": 5, "expires": 30, "headers": {"x": 1}}
    spec = make_spec(
        "n",
        "t",
        60,
        app=app,
        args=[1, "a"],
        kwargs={"k": [1, 2]},
        options=options,
        misfire="all",
        overlap=OverlapPolicy.SKIP,
        catchup_window=600,
        max_catchup=3,
        source="static",
        enabled=False,
    )
    assert spec.args == (1, "a") and dict(spec.kwargs) == {"k": [1, 2]}
    assert dict(spec.options) == options
    assert (spec.misfire, spec.overlap) == (MisfirePolicy.ALL, OverlapPolicy.SKIP)
    assert (spec.catchup_window, spec.max_catchup) == (600.0, 3)
    assert (spec.source, spec.enabled) == ("static", False)


# -- beat_schedule entries and the app ----------------------------------------------------------


def test_spec_from_entry_reads_beat_and_celery_sched_keys(app: Celery) -> None:
    entry = {
        "task": "tasks.report",
        "schedule": crontab(minute="0", hour="7"),
        "args": (1,),
        "kwargs": {"fmt": "pdf"},
        "options": {"queue": "reports"},
        "misfire": "skip",
        "overlap": "skip",
        "catchup_window": 60,
        "max_catchup": 2,
        "timezone": "Europe/London",
    }
    spec = spec_from_entry("daily-report", entry, app=app)
    assert (spec.name, spec.task, spec.kind, spec.source) == (
        "daily-report",
        "tasks.report",
        "crontab",
        "static",
    )
    assert spec.args == (1,) and dict(spec.kwargs) == {"fmt": "pdf"}
    assert spec.timezone == "Europe/London" and spec.misfire is MisfirePolicy.SKIP
    assert set(entry) <= ENTRY_KEYS
    with pytest.raises(InvalidSchedule, match="unknown key\\(s\\) colour"):
        spec_from_entry("x", {"task": "t", "schedule": 5, "colour": "red"}, app=app)
    with pytest.raises(InvalidSchedule, match="has no 'schedule'"):
        spec_from_entry("x", {"task": "t"}, app=app)
    with pytest.raises(InvalidSchedule, match="has no 'task'"):
        spec_from_entry("x", {"schedule": 5}, app=app)
    with pytest.raises(InvalidSchedule, match="must be a mapping"):
        spec_from_entry("x", [("task", "t")], app=app)  # type: ignore[arg-type]
    relative = spec_from_entry("r", {"task": "t", "schedule": 3600, "relative": True}, app=app)
    assert relative.relative is True


class FakePeriodicTask(Task):  # type: ignore[misc]
    """Stands in for celery_sched.Task: the decorator's attributes, all None."""

    abstract = True
    periodic_schedule: Any = None
    schedule_name: Any = None
    schedule_args: Any = None
    schedule_kwargs: Any = None
    schedule_options: Any = None
    schedule_timezone: Any = None
    misfire: Any = None
    overlap: Any = None
    catchup_window: Any = None
    max_catchup: Any = None
    schedule_relative: Any = None


def test_specs_from_app_reads_every_source() -> None:
    app = Celery("t")
    when = at("2030-01-01 00:00")
    app.conf.timezone = "Europe/London"
    app.conf.beat_schedule = {
        "cron": {"task": "tasks.a", "schedule": crontab(minute="*/5")},
        "delta": {"task": "tasks.a", "schedule": dt.timedelta(seconds=30), "args": (1,)},
        "number": {"task": "tasks.a", "schedule": 10.0, "options": {"queue": "q"}},
        "aligned": {"task": "tasks.a", "schedule": schedule(3600, relative=True)},
        "sun": {"task": "tasks.a", "schedule": solar("sunrise", 51.5, -0.1)},
        "once": {"task": "tasks.a", "schedule": clocked(when), "misfire": "all"},
    }

    @app.on_after_configure.connect  # type: ignore[untyped-decorator]
    def add_more(sender: Celery, **_: Any) -> None:
        sender.add_periodic_task(15.0, sender.signature("tasks.b", args=(2,)), name="added")

    @app.task(
        base=FakePeriodicTask,
        shared=False,
        periodic_schedule=crontab(minute="0", hour="3"),
        misfire="skip",
        overlap="skip",
        schedule_args=(7,),
        schedule_options={"priority": 3},
    )
    def nightly(n: int) -> int:
        return n

    @app.task(base=FakePeriodicTask, shared=False, periodic_schedule=60, schedule_name="minutely")
    def every_minute() -> None:
        return None

    @app.task(base=FakePeriodicTask, shared=False)
    def not_periodic() -> None:
        return None

    @app.task(shared=False)
    def plain() -> None:
        return None

    specs = {spec.name: spec for spec in specs_from_app(app)}
    assert list(specs)[:7] == ["cron", "delta", "number", "aligned", "sun", "once", "added"]
    assert set(specs) == {
        "cron",
        "delta",
        "number",
        "aligned",
        "sun",
        "once",
        "added",
        nightly.name,
        "minutely",
    }
    assert all(spec.source == "static" for spec in specs.values())
    assert [specs[n].kind for n in ("cron", "delta", "number", "aligned", "sun", "once")] == [
        "crontab",
        "interval",
        "interval",
        "interval",
        "solar",
        "clocked",
    ]
    assert specs["cron"].timezone == "Europe/London"
    assert specs["delta"].args == (1,) and dict(specs["number"].options) == {"queue": "q"}
    assert specs["aligned"].relative is True
    assert specs["once"].misfire is MisfirePolicy.ALL
    assert specs["added"].task == "tasks.b" and specs["added"].args == (2,)
    assert specs["added"].spec["seconds"] == 15.0
    decorated = specs[nightly.name]
    assert decorated.task == nightly.name and decorated.kind == "crontab"
    assert decorated.args == (7,) and dict(decorated.options) == {"priority": 3}
    assert decorated.misfire is MisfirePolicy.SKIP and decorated.overlap is OverlapPolicy.SKIP
    assert specs["minutely"].task == every_minute.name


def test_specs_from_app_refuses_duplicate_names_and_bad_entries() -> None:
    app = Celery("t")
    app.conf.beat_schedule = {"tick": {"task": "tasks.a", "schedule": 5}}

    @app.task(base=FakePeriodicTask, shared=False, periodic_schedule=5, schedule_name="tick")
    def tick() -> None:
        return None

    with pytest.raises(InvalidSchedule, match="two periodic schedules are named 'tick'"):
        specs_from_app(app)

    broken = Celery("t2")
    broken.conf.beat_schedule = {"bad": {"task": "tasks.a", "schedule": "61 * * * *"}}
    with pytest.raises(InvalidSchedule, match=r"'bad'.*minute='61'"):
        specs_from_app(broken)


def test_add_periodic_task_after_configuration_is_seen() -> None:
    app = Celery("t")
    app.conf.beat_schedule = {}
    _ = app.conf.timezone  # configured now
    app.add_periodic_task(crontab(minute="1"), app.signature("tasks.c"), name="late")
    assert [spec.name for spec in specs_from_app(app)] == ["late"]


# -- round trips through schedule objects -----------------------------------------------------


def test_schedule_from_spec_round_trips(app: Celery) -> None:
    values: list[tuple[object, dict[str, Any]]] = [
        (crontab(minute="*/5", hour="1-3", day_of_week="mon"), {"timezone": "Asia/Tokyo"}),
        (dt.timedelta(seconds=90), {"relative": True}),
        (solar("dusk_civil", -33.9, 151.2), {}),
        (clocked(at("2031-05-05 05:05")), {}),
    ]
    for value, extra in values:
        spec = make_spec("r", "t", value, app=app, **extra)
        back = schedule_from_spec(spec, app=app)
        again = make_spec("r", "t", back, app=app, timezone=spec.timezone)
        assert (again.kind, dict(again.spec), again.relative) == (
            spec.kind,
            dict(spec.spec),
            spec.relative,
        )
    cron = schedule_from_spec(
        make_spec("c", "t", "0 4 * * *", app=app, timezone="Asia/Tokyo"), app=app
    )
    assert isinstance(cron, crontab) and str(cron.tz) == "Asia/Tokyo"  # type: ignore[attr-defined]


def test_specs_that_do_not_evaluate_raise_invalid_schedule() -> None:
    for kind, definition in [
        ("interval", {"seconds": 0}),
        ("interval", {}),
        ("crontab", {"minute": "99", "hour": "*"}),
        ("crontab", dict.fromkeys(["minute", "hour", "day_of_week", "day_of_month"], "*")),
        ("solar", {"event": "noonish", "lat": 0, "lon": 0}),
        ("solar", {"event": "sunrise", "lat": 95, "lon": 0}),
        ("clocked", {"at": "yesterday"}),
        ("clocked", {"at": "2030-01-01T00:00:00"}),  # no offset
    ]:
        spec = ScheduleSpec(name="n", task="t", kind=kind, spec=definition)
        with pytest.raises(InvalidSchedule, match="'n'"):
            next_after(spec, T0)


# -- first_after / next_after ------------------------------------------------------------------


def test_interval_first_after_and_no_drift(app: Celery) -> None:
    spec = interval(app, 60)
    now = at("2024-01-01 10:17:23.5")
    assert first_after(spec, now) == now + MIN
    late = at("2024-01-01 10:30:00")  # however late the planner asks
    assert next_after(spec, at("2024-01-01 10:18:23.5")) == at("2024-01-01 10:19:23.5")
    assert next_after(spec, at("2024-01-01 10:18:23.5")) < late


@pytest.mark.parametrize(
    ("every", "now", "zone"),
    [
        (HOUR, "2024-01-01 10:17:00", "UTC"),
        (dt.timedelta(minutes=90), "2024-01-01 10:17:00", "UTC"),
        (dt.timedelta(minutes=15), "2024-01-01 10:17:30", "UTC"),
        (dt.timedelta(seconds=30), "2024-01-01 10:17:05.000500", "UTC"),
        (DAY, "2024-03-30 10:17:00", "Europe/Berlin"),  # the next local midnight
        (HOUR, "2024-01-01 10:17:00", "Asia/Kolkata"),  # a half-hour offset
    ],
)
def test_relative_interval_aligns_like_beat(
    app: Celery, every: dt.timedelta, now: str, zone: str
) -> None:
    spec = make_spec("r", "t", every, app=app, relative=True, timezone=zone)
    tz = zoneinfo.ZoneInfo(zone)
    start = dt.datetime.fromisoformat(now).replace(tzinfo=tz)
    beat = start + remaining(start, every, start, relative=True)
    first = first_after(spec, start.astimezone(UTC))
    assert first == beat.astimezone(UTC)
    assert next_after(spec, first) == first + every  # then steps of `every`, no re-rounding


# Pacific/Chatham falls back at 03:45 +13:45 to 02:45 +12:45 on 7 April 2024, so 02:45-03:45
# happens twice (13:00Z-14:00Z, then 14:00Z-15:00Z); Lord Howe falls back at 02:00 +11 to
# 01:30 +10:30 the same day (15:00Z).
@pytest.mark.parametrize(
    ("zone", "every", "now", "first"),
    [
        # 02:46 +12:45 (second pass) + 1 h = 03:46 +12:45: the last 03:00 before it is the
        # second pass, 03:00 +12:45 (not the first pass, 13:15Z, which is before now).
        ("Pacific/Chatham", HOUR, "2024-04-06 14:01", "2024-04-06 14:15"),
        # 02:50 +13:45 + 2 h = 03:50 +12:45: both passes of 03:00 come before it, the last wins.
        ("Pacific/Chatham", 2 * HOUR, "2024-04-06 13:05", "2024-04-06 14:15"),
        # 02:50 +13:45 + 1 h = 02:50 +12:45, whose hour (02:00 +13:45) is before now: no
        # boundary lies in (now, now + every], so the next one counts: 03:00 +13:45.
        ("Pacific/Chatham", HOUR, "2024-04-06 13:05", "2024-04-06 13:15"),
        # 01:10 +11 + 1 h = 01:40 +10:30; 01:00 is before now: the next boundary, 02:00 +10:30.
        ("Australia/Lord_Howe", HOUR, "2024-04-06 14:10", "2024-04-06 15:30"),
    ],
)
def test_relative_interval_planned_around_a_repeated_hour_stays_aligned(
    app: Celery, zone: str, every: dt.timedelta, now: str, first: str
) -> None:
    spec = make_spec("r", "t", every, app=app, relative=True, timezone=zone)
    local = at(now).astimezone(zoneinfo.ZoneInfo(zone))
    # Beat sleeps for remaining(): real time, so add it to the UTC instant.
    assert at(now) + remaining(local, every, local, relative=True) == at(first)
    assert first_after(spec, at(now)) == at(first)
    assert next_after(spec, at(first)) == at(first) + every


def test_next_after_rejects_naive_instants(app: Celery) -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        next_after(make_spec("c", "t", "* * * * *", app=app), dt.datetime(2024, 1, 1))


def test_crontab_next_after_is_fast(app: Celery) -> None:
    """No minute-by-minute scans: sparse crontabs skip whole months and years."""
    leap_monday = make_spec("c", "t", "0 9 29 2 1", app=app, timezone="America/New_York")
    started = time.perf_counter()
    found = next_after(leap_monday, T0)
    assert found is not None and found.astimezone(zoneinfo.ZoneInfo("America/New_York")) == (
        dt.datetime(2044, 2, 29, 9, tzinfo=zoneinfo.ZoneInfo("America/New_York"))
    )
    assert time.perf_counter() - started < 0.05
    dense = make_spec("d", "t", "*/5 * * * *", app=app, timezone="Europe/London")
    moment = T0
    started = time.perf_counter()
    for _ in range(2000):
        moment = next_after(dense, moment)  # type: ignore[assignment]
    assert (time.perf_counter() - started) / 2000 < 200e-6  # generous: ~5 us measured
    assert moment == T0 + 2000 * 5 * MIN


# -- plan: new schedules, horizon, limit -------------------------------------------------------


def test_new_schedule_starts_after_now_and_fills_the_horizon(app: Celery) -> None:
    spec = interval(app, 10)
    result = planned(spec, last_nominal=None, now=T0, horizon=T0 + 35 * S)
    assert result.occurrences == [T0 + 10 * S, T0 + 20 * S, T0 + 30 * S]
    assert result.skipped == 0
    assert result.cursor == T0 + 30 * S and result.next_nominal == T0 + 40 * S


def test_new_schedule_beyond_the_horizon_keeps_its_anchor(app: Celery) -> None:
    """A daily interval first planned at T0 fires at T0 + 1 day, however
    often the planner looks before then (the cursor carries the anchor)."""
    spec = interval(app, 86400)
    first = planned(spec, last_nominal=None, now=T0, horizon=T0 + MIN)
    assert first.occurrences == [] and first.next_nominal == T0 + DAY
    assert first.cursor == T0
    later = planned(spec, last_nominal=first.cursor, now=T0 + HOUR, horizon=T0 + HOUR + MIN)
    assert later.occurrences == [] and later.next_nominal == T0 + DAY
    due = planned(spec, last_nominal=later.cursor, now=T0 + DAY - S, horizon=T0 + DAY + MIN)
    assert due.occurrences == [T0 + DAY]


def test_exhausted_schedules(app: Celery) -> None:
    past = make_spec("c", "t", clocked(T0), app=app)
    result = planned(past, last_nominal=None, now=T0 + HOUR, horizon=T0 + 2 * HOUR)
    assert result == Plan(occurrences=[], skipped=0, cursor=None, next_nominal=None)
    done = planned(past, last_nominal=T0, now=T0 + HOUR, horizon=T0 + 2 * HOUR)
    assert done.occurrences == [] and done.cursor == T0 and done.next_nominal is None


def test_limit_bounds_one_call_and_the_next_continues(app: Celery) -> None:
    spec = interval(app, 1)
    first = planned(spec, last_nominal=T0, now=T0, horizon=T0 + 100 * S, limit=30)
    assert first.occurrences == [T0 + k * S for k in range(1, 31)]
    assert first.cursor == T0 + 30 * S and first.next_nominal == T0 + 31 * S
    rest = planned(spec, last_nominal=first.cursor, now=T0, horizon=T0 + 100 * S, limit=1000)
    assert rest.occurrences == [T0 + k * S for k in range(31, 101)]
    with pytest.raises(ValueError, match="limit"):
        planned(spec, last_nominal=T0, now=T0, horizon=T0, limit=0)


# -- plan: misfire policies -----------------------------------------------------------------


def outage(app: Celery, **kw: Any) -> Plan:
    """A */10-minute crontab last planned at 00:00, planner back at 01:05:30."""
    spec = make_spec("c", "t", "*/10 * * * *", app=app, timezone="UTC", **kw)
    return planned(
        spec,
        last_nominal=at("2024-01-01 00:00"),
        now=at("2024-01-01 01:05:30"),
        horizon=at("2024-01-01 01:25"),
    )


def test_misfire_skip_runs_only_future_occurrences(app: Celery) -> None:
    result = outage(app, misfire="skip")
    assert result.occurrences == [at("2024-01-01 01:10"), at("2024-01-01 01:20")]
    assert result.skipped == 6  # 00:10 ... 01:00
    assert result.cursor == at("2024-01-01 01:20")


def test_misfire_once_runs_the_latest_missed_once(app: Celery) -> None:
    result = outage(app)  # the default policy here is "once", as beat
    assert result.occurrences == [
        at("2024-01-01 01:00"),
        at("2024-01-01 01:10"),
        at("2024-01-01 01:20"),
    ]
    assert result.skipped == 5
    assert result.next_nominal == at("2024-01-01 01:30")


def test_misfire_all_runs_each_missed_one_within_window_and_count(app: Celery) -> None:
    everything = outage(app, misfire="all")
    assert everything.occurrences[:6] == [at(f"2024-01-01 00:{m}0") for m in range(1, 6)] + [
        at("2024-01-01 01:00")
    ]
    assert everything.skipped == 0
    windowed = outage(app, misfire="all", catchup_window=30 * 60)  # since 00:35:30
    assert windowed.occurrences[:3] == [
        at("2024-01-01 00:40"),
        at("2024-01-01 00:50"),
        at("2024-01-01 01:00"),
    ]
    assert windowed.skipped == 3
    capped = outage(app, misfire="all", max_catchup=2)  # the latest two kept
    assert capped.occurrences[:2] == [at("2024-01-01 00:50"), at("2024-01-01 01:00")]
    assert capped.skipped == 4
    none = outage(app, misfire="all", max_catchup=0)
    assert none.occurrences == [at("2024-01-01 01:10"), at("2024-01-01 01:20")]
    assert none.skipped == 6


def test_default_policy_and_limits_come_from_the_arguments(app: Celery) -> None:
    spec = make_spec("c", "t", "*/10 * * * *", app=app, timezone="UTC")
    result = planned(
        spec,
        last_nominal=at("2024-01-01 00:00"),
        now=at("2024-01-01 01:05:30"),
        horizon=at("2024-01-01 01:05:30"),
        default_misfire="all",
        catchup_window=3600.0,
        max_catchup=3,
    )
    assert result.occurrences == [
        at("2024-01-01 00:40"),
        at("2024-01-01 00:50"),
        at("2024-01-01 01:00"),
    ]
    assert result.skipped == 3


def test_grace_keeps_a_slightly_late_occurrence_on_time(app: Celery) -> None:
    spec = make_spec("c", "t", "*/10 * * * *", app=app, timezone="UTC", misfire="skip")
    late = planned(
        spec,
        last_nominal=at("2024-01-01 00:50"),
        now=at("2024-01-01 01:00:04"),
        horizon=at("2024-01-01 01:00:04"),
        grace=5.0,
    )
    assert late.occurrences == [at("2024-01-01 01:00")] and late.skipped == 0
    missed = planned(
        spec,
        last_nominal=at("2024-01-01 00:50"),
        now=at("2024-01-01 01:00:06"),
        horizon=at("2024-01-01 01:00:06"),
        grace=5.0,
    )
    assert missed.occurrences == [] and missed.skipped == 1
    assert missed.cursor == at("2024-01-01 01:00")


def test_years_of_downtime_cost_nothing(app: Celery) -> None:
    """Missed occurrences are counted, never visited one by one."""
    every_second = interval(app, 1, misfire="all", max_catchup=3)
    cron = make_spec("c", "t", "* * * * *", app=app, timezone="America/New_York", misfire="skip")
    back = at("2029-01-01 00:00")
    started = time.perf_counter()
    fast = planned(every_second, last_nominal=T0, now=back, horizon=back, grace=0)
    slow = planned(cron, last_nominal=T0, now=back, horizon=back, grace=0)
    assert time.perf_counter() - started < 1.0
    seconds = int((back - T0).total_seconds())
    # `back` itself is due now, not missed.
    assert fast.occurrences == [back - 3 * S, back - 2 * S, back - S, back]
    assert fast.skipped == seconds - 1 - 3
    # `* * * * *` is a wildcard job, run by the new wall clock: every real
    # minute strictly between, both passes of each fall's repeated hour
    # included, and no made-up minutes for each spring's skipped hour.
    assert slow.occurrences == [back]
    assert slow.skipped == seconds // 60 - 1
    assert slow.cursor == back


# -- properties -------------------------------------------------------------------------------

ZONES = ["UTC", "America/New_York", "Europe/London", "Australia/Lord_Howe", "Asia/Tokyo"]
# Instants near DST changes, where mistakes would show.
STARTS = [
    at("2024-03-10 06:00"),
    at("2024-11-03 04:30"),
    at("2024-03-31 00:00"),
    at("2024-10-26 23:30"),
    at("2024-04-06 14:00"),
    at("2024-10-05 14:30"),
    at("2024-06-15 12:00"),
]


def _field(low: int, high: int, max_size: int) -> st.SearchStrategy[str]:
    values = st.sets(st.integers(low, high), min_size=1, max_size=max_size)
    return st.one_of(
        st.just("*"),
        st.integers(1, 7).map(lambda step: f"*/{step}"),
        values.map(lambda chosen: ",".join(map(str, sorted(chosen)))),
    )


cron_fields = st.fixed_dictionaries(
    {
        "minute": _field(0, 59, 6),
        "hour": _field(0, 23, 6),
        "day_of_week": _field(0, 6, 4),
        "day_of_month": _field(1, 28, 8),
        "month_of_year": _field(1, 12, 6),
    }
)


def reference_instants(wall: dt.datetime, tz: dt.tzinfo, *, wildcard: bool) -> list[dt.datetime]:
    """The documented rules, the slow obvious way. A wildcard job runs at
    every instant whose local time is ``wall``: none in a gap, two in a
    repeat. A fixed-time job runs a wall time that exists at its first
    instant, one that does not at the first existing minute after it."""
    real = [
        instant
        for fold in (0, 1)
        if (instant := wall.replace(tzinfo=tz, fold=fold).astimezone(UTC))
        .astimezone(tz)
        .replace(tzinfo=None)
        == wall
    ]
    if wildcard:
        return sorted(set(real))
    while not real:
        wall += MIN
        real = reference_instants(wall, tz, wildcard=True)
    return real[:1]


def reference_next(fields: dict[str, str], zone: str, after: dt.datetime) -> dt.datetime | None:
    cron: Any = crontab(**fields)
    tz = zoneinfo.ZoneInfo(zone)
    wildcard = fields["minute"].startswith("*") or fields["hour"].startswith("*")
    day = after.astimezone(tz).date() - DAY
    for _ in range(366 * 12):
        if (
            day.month in cron.month_of_year
            and day.day in cron.day_of_month
            and day.isoweekday() % 7 in cron.day_of_week
        ):
            # A repeated hour's second pass can come before a later wall
            # time's only instant: gather the day's instants, then sort.
            found = sorted(
                instant
                for hour in cron.hour
                for minute in cron.minute
                for instant in reference_instants(
                    dt.datetime(day.year, day.month, day.day, hour, minute), tz, wildcard=wildcard
                )
                if instant > after
            )
            if found:
                return found[0]
        day += DAY
    return None


def _every(minute: str, hour: str = "*") -> dict[str, str]:
    return dict(minute=minute, hour=hour, day_of_week="*", day_of_month="*", month_of_year="*")


# `offset` 86400 s puts `after` at the start instant; folds and gaps come first.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=cron_fields,
    zone=st.sampled_from(ZONES),
    start=st.sampled_from(STARTS),
    offset=st.integers(0, 3 * 86400 * 1_000_000),
)
@example(_every("0"), "America/New_York", at("2024-11-03 04:30"), 86400 * 1_000_000)
@example(_every("*/15", "1"), "Europe/London", at("2024-10-26 23:30"), 86400 * 1_000_000)
@example(_every("30"), "America/New_York", at("2024-03-10 06:00"), 86400 * 1_000_000)
@example(_every("*/15"), "Australia/Lord_Howe", at("2024-04-06 14:00"), 86400 * 1_000_000)
@example(_every("0,15,30,45", "1,2"), "America/New_York", at("2024-11-03 04:30"), 86400 * 1_000_000)
def test_crontab_next_after_equals_the_reference_rule(
    fields: dict[str, str], zone: str, start: dt.datetime, offset: int
) -> None:
    spec = make_spec("p", "t", crontab(**fields), app=Celery("p"), timezone=zone)
    after = start + dt.timedelta(microseconds=offset - 86400 * 1_000_000)
    moment = after
    for _ in range(5):
        found = next_after(spec, moment)
        assert found == reference_next(fields, zone, moment)
        if found is None:
            break
        assert found > moment  # strictly increasing
        moment = found


@settings(max_examples=100, deadline=None)
@given(
    every=st.integers(1, 4 * 3600 * 1000).map(lambda ms: ms / 1000),
    gaps=st.lists(st.integers(0, 6 * 3600), min_size=1, max_size=6),
    policy=st.sampled_from(list(MisfirePolicy)),
    relative=st.booleans(),
)
def test_interval_plans_never_drift(
    every: float, gaps: list[int], policy: MisfirePolicy, relative: bool
) -> None:
    spec = make_spec("i", "t", every, app=Celery("p"), relative=relative, misfire=policy)
    step = dt.timedelta(seconds=every)
    now = at("2024-03-10 05:17:42.123456")
    last: dt.datetime | None = None
    origin: dt.datetime | None = None
    for gap in gaps:
        now += dt.timedelta(seconds=gap)
        result = planned(spec, last_nominal=last, now=now, horizon=now + MIN)
        for moment in result.occurrences:
            origin = origin or moment
            assert (moment - origin) % step == dt.timedelta(0)
        if result.cursor is not None and origin is not None:
            assert (result.cursor - origin) % step == dt.timedelta(0)
        last = result.cursor


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(["interval", "cron"]),
    seconds=st.integers(20, 7200),
    fields=cron_fields.filter(lambda f: f["minute"] != "*" and not f["minute"].startswith("*/1")),
    zone=st.sampled_from(ZONES),
    start=st.sampled_from(STARTS),
    policy=st.sampled_from(list(MisfirePolicy)),
    window=st.integers(0, 2 * 86400),
    most=st.integers(0, 20),
    grace=st.integers(0, 120),
    limit=st.integers(1, 50),
    steps=st.lists(
        st.tuples(st.integers(0, 2 * 86400), st.integers(0, 3 * 3600)), min_size=1, max_size=5
    ),
)
def test_plans_are_unique_ordered_and_bounded(
    kind: str,
    seconds: int,
    fields: dict[str, str],
    zone: str,
    start: dt.datetime,
    policy: MisfirePolicy,
    window: int,
    most: int,
    grace: int,
    limit: int,
    steps: list[tuple[int, int]],
) -> None:
    app = Celery("p")
    schedule_value: object = seconds if kind == "interval" else crontab(**fields)
    spec = make_spec("p", "t", schedule_value, app=app, timezone=zone)
    now = start
    last: dt.datetime | None = None
    seen: set[dt.datetime] = set()
    for advance, ahead in steps:
        now += dt.timedelta(seconds=advance)
        horizon = now + dt.timedelta(seconds=ahead)
        cutoff = now - dt.timedelta(seconds=grace)
        result = plan(
            spec,
            last_nominal=last,
            now=now,
            horizon=horizon,
            default_misfire=policy,
            catchup_window=float(window),
            max_catchup=most,
            grace=float(grace),
            limit=limit,
        )
        got = result.occurrences
        assert got == sorted(set(got))
        assert not seen & set(got)
        seen |= set(got)
        missed_run = [moment for moment in got if moment < cutoff]
        future = [moment for moment in got if moment >= cutoff]
        assert len(future) <= limit and all(moment <= horizon for moment in future)
        if last is None:
            assert missed_run == [] and result.skipped == 0
        else:
            assert all(moment > last for moment in got)
            missed = enumerate_between(spec, last, cutoff)
            if policy is MisfirePolicy.SKIP:
                expected: list[dt.datetime] = []
            elif policy is MisfirePolicy.ONCE:
                expected = missed[-1:]
            else:
                floor = now - dt.timedelta(seconds=window)
                expected = [moment for moment in missed if moment >= floor][-most:] if most else []
            assert missed_run == expected
            assert result.skipped == len(missed) - len(expected)
            if future:  # nothing between the missed and the future ones was lost
                assert future == enumerate_between(
                    spec, missed[-1] if missed else last, future[-1] + S
                )
        if result.cursor is None:
            assert result.next_nominal is None
        else:
            assert result.next_nominal == next_after(spec, result.cursor)
        last = result.cursor
