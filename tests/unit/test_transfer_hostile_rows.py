"""``sched import``'s readers against hostile input: every row either comes
out valid or is refused with a one-line reason; none ends the import.

Hand-picked rows per source (deep nesting, huge, infinite and NaN numbers,
negative intervals, enormous strings, wrong types, unknown timezones, bad
crontab fields), then hypothesis over each reader."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_sched.client import Client
from celery_sched.settings import Settings
from celery_sched.store.memory import MemoryJobStore
from celery_sched.transfer import django_celery_beat, job_rows, redbeat, schedule_file
from celery_sched.transfer.schedule_entries import ScheduleEntry, Skipped, import_entries

DEEP = "[" * 5000 + "]" * 5000
DEEP_OBJECT = '{"a":' * 5000 + "1" + "}" * 5000
#: Just under Python's recursion limit: json.loads takes it, encoders do not.
NEARLY_TOO_DEEP = '{"a":' + "[" * 980 + "]" * 980 + "}"
HUGE_INT = "1" + "0" * 5000
BIG = "x" * 1_000_000


def make_app() -> Celery:
    app = Celery("hostile", broker="memory://", set_as_current=False)
    app.conf.timezone = "UTC"

    @app.task(name="t", shared=False)
    def t(*args: Any, **kwargs: Any) -> None:
        return None

    return app


APP = make_app()


@pytest.fixture
def client() -> Iterator[Client]:
    with Client(APP, settings=Settings(), store=MemoryJobStore(), staging=False) as client:
        yield client


def one_line(reason: str) -> None:
    assert "\n" not in reason and 0 < len(reason) <= 300, reason[:400]


# -- one-off jobs (CSV and JSON lines) -------------------------------------------------

HOSTILE_JSONL = [
    DEEP,
    DEEP_OBJECT,
    '{"task": "t", "args": ' + DEEP + "}",
    '{"task": "t", "kwargs": ' + NEARLY_TOO_DEEP + "}",
    '{"task": "t", "headers": ' + DEEP_OBJECT + "}",
    '{"task": "t", "args": [' + HUGE_INT + "]}",
    '{"task": "t", "countdown": ' + HUGE_INT + "}",
    '{"task": "t", "countdown": 1e300}',
    '{"task": "t", "countdown": -5}',
    '{"task": "t", "countdown": NaN}',
    '{"task": "t", "countdown": Infinity}',
    '{"task": "t", "expires": 1e300}',
    '{"task": "t", "priority": 1e300}',
    '{"task": "t", "eta": 12}',
    '{"task": "t", "eta": "9999-12-31T23:59:59+14:00"}',
    json.dumps({"task": "t", "key": BIG}),
    json.dumps({"task": BIG}),
    '{"task": 5}',
    '{"task": "t", "kwargs": [1]}',
    '{"task": "t", "queue": ["x"]}',
]


def test_hostile_json_lines_are_refused_one_by_one(client: Client) -> None:
    good = '{"task": "t", "key": "good", "args": [1]}'
    lines = [good, *HOSTILE_JSONL, good.replace("good", "good-too")]
    report = job_rows.import_rows(client, job_rows.read_rows(lines, "jsonl"), chunk_size=1000)
    refused = dict(report.refused)
    assert sorted(refused) == list(range(2, len(lines)))
    for reason in refused.values():
        one_line(reason)
    assert "nested more than 100 levels" in refused[2] and "nested" in refused[5]
    assert report.written == 2 and not report.failed_chunks
    assert client.get("good") is not None and client.get("good-too") is not None


def test_hostile_csv_cells_are_refused_one_by_one(client: Client) -> None:
    deep = DEEP.replace('"', '""')
    text = (
        "task,key,args,headers,countdown,priority\n"
        "t,good,[1],,,\n"
        f't,a,"{deep}",,,\n'
        f't,b,,"{DEEP_OBJECT.replace(chr(34), chr(34) * 2)}",,\n'
        f"t,c,[{HUGE_INT}],,,\n"
        "t,d,,,1e300,\n"
        f"t,e,,,,{HUGE_INT}\n"
        "t,f,,,nan,\n"
    )
    rows = job_rows.read_rows(io.StringIO(text, newline=""), "csv")
    report = job_rows.import_rows(client, rows, chunk_size=1000)
    assert [line for line, _ in report.refused] == [3, 4, 5, 6, 7, 8]
    for _, reason in report.refused:
        one_line(reason)
    assert "column args: JSON nested more than 100 levels deep" in report.refused[0][1]
    assert report.written == 1


# -- schedules: the export file, redbeat, django-celery-beat --------------------------------


def schedule_line(**changes: Any) -> str:
    row = {"name": "s", "task": "t", "schedule": {"kind": "interval", "seconds": 60}}
    row.update(changes)
    return json.dumps(row)


def cron(**fields: Any) -> dict[str, Any]:
    spec = {"kind": "crontab", "minute": "0", "hour": "*", "day_of_week": "*"}
    spec.update({"day_of_month": "*", "month_of_year": "*"})
    spec.update(fields)
    return spec


HOSTILE_SCHEDULES = [
    DEEP,
    '{"name": "s", "task": "t", "schedule": {"kind": "interval", "seconds": ' + DEEP + "}}",
    schedule_line(schedule={"kind": "interval", "seconds": 1e300}),
    schedule_line(schedule={"kind": "interval", "seconds": 10**30}),
    schedule_line(schedule={"kind": "interval", "seconds": -5}),
    '{"name": "s", "task": "t", "schedule": {"kind": "interval", "seconds": NaN}}',
    '{"name": "s", "task": "t", "schedule": {"kind": "interval", "seconds": Infinity}}',
    '{"name": "s", "task": "t", "schedule": {"kind": "interval", "seconds": ' + HUGE_INT + "}}",
    '{"name": "s", "task": "t", "schedule": {"kind": "solar", "event": "sunrise", '
    '"lat": NaN, "lon": 0}}',
    schedule_line(schedule={"kind": "solar", "event": "sunrise", "lat": [1], "lon": 0}),
    schedule_line(schedule=cron(minute="61")),
    schedule_line(schedule=cron(minute="1-" + "9" * 5000)),
    schedule_line(schedule=cron(hour=None, day_of_week=[1])),
    schedule_line(schedule={"kind": "clocked", "at": "99999"}),
    schedule_line(timezone="Mars/Olympus"),
    schedule_line(timezone=BIG),
    schedule_line(name=BIG),
    schedule_line(args=5),
    schedule_line(catchup_window=1e300),
    schedule_line(options={"headers": json.loads('{"a":' * 150 + "1" + "}" * 150)}),
    '{"name": "s", "task": "t", "schedule": {"kind": "interval", "seconds": 1}, '
    '"kwargs": ' + NEARLY_TOO_DEEP + "}",
]


def test_hostile_schedule_file_rows_are_refused_one_by_one(client: Client) -> None:
    good = schedule_line(name="good")
    entries = list(schedule_file.read_entries([good, *HOSTILE_SCHEDULES], app=APP))
    result = import_entries(client, entries, check_task=True)
    assert [entry.name for entry in result.added] == ["good"]
    assert len(result.skipped) == len(HOSTILE_SCHEDULES)
    for skip in result.skipped:
        assert skip.refused, skip
        one_line(skip.reason)
        assert len(skip.name) <= 100


def redbeat_definition(**changes: Any) -> str:
    definition = {"name": "r", "task": "t", "schedule": {"__type__": "interval", "every": 60}}
    definition.update(changes)
    return json.dumps(definition)


HOSTILE_REDBEAT = [
    redbeat_definition(schedule={"__type__": "interval", "every": 1e300}),
    redbeat_definition(schedule={"__type__": "interval", "every": -1}),
    '{"name": "r", "task": "t", "schedule": {"__type__": "interval", "every": NaN}}',
    '{"name": "r", "task": "t", "schedule": {"__type__": "interval", "every": Infinity}}',
    redbeat_definition(schedule={"__type__": "crontab", "minute": "61"}),
    redbeat_definition(schedule={"__type__": "crontab", "nope": "1"}),
    redbeat_definition(schedule={"__type__": "rrule"}),
    redbeat_definition(
        last_run_at={
            "__type__": "datetime",
            "year": 2030,
            "month": 1,
            "day": 1,
            "hour": 0,
            "minute": 0,
            "second": 0,
            "timezone": 1e300,
        }
    ),
    redbeat_definition(last_run_at={"__type__": "datetime", "timezone": "Mars/Olympus"}),
    redbeat_definition(options={"schedule": 1}),
    redbeat_definition(options=[1]),
    redbeat_definition(name=5),
    redbeat_definition(args=5),
    "[1, 2]",
    DEEP,
    redbeat_definition(kwargs={"a": json.loads("[" * 150 + "]" * 150)}),
]


def test_hostile_redbeat_definitions_are_refused_one_by_one(client: Client) -> None:
    good = redbeat_definition(name="good")
    texts = [good, *HOSTILE_REDBEAT]
    entries = [
        redbeat.entry_of(f"redbeat:e{n}", f"e{n}", text, set(), APP) for n, text in enumerate(texts)
    ]
    result = import_entries(client, entries, check_task=True)
    assert [entry.name for entry in result.added] == ["good"]
    assert len(result.skipped) == len(HOSTILE_REDBEAT)
    for skip in result.skipped:
        assert skip.refused, skip
        one_line(skip.reason)


def dcb_row(**changes: Any) -> dict[str, Any]:
    import datetime as dt

    row: dict[str, Any] = dict.fromkeys(
        (
            "args",
            "kwargs",
            "queue",
            "exchange",
            "routing_key",
            "headers",
            "priority",
            "expires",
            "expire_seconds",
            "start_time",
            "crontab_id",
            "minute",
            "hour",
            "day_of_week",
            "day_of_month",
            "month_of_year",
            "timezone",
            "solar_id",
            "event",
            "latitude",
            "longitude",
            "clocked_id",
            "clocked_time",
        )
    )
    row.update(name="d", task="t", one_off=False, enabled=True, interval_id=1, every=60)
    row.update(period="seconds", db_now=dt.datetime.now(dt.UTC))
    row.update(changes)
    return row


HOSTILE_DCB = [
    dcb_row(every=2**31 - 1, period="days"),
    dcb_row(every=-5),
    dcb_row(every=None),
    dcb_row(period="fortnights"),
    dcb_row(args=DEEP),
    dcb_row(args="[" + HUGE_INT + "]"),
    dcb_row(kwargs=NEARLY_TOO_DEEP),
    dcb_row(headers='{"a": ' + DEEP + "}"),
    dcb_row(args='{"not": "a list"}'),
    dcb_row(
        interval_id=None,
        crontab_id=1,
        minute="61",
        hour="*",
        day_of_week="*",
        day_of_month="*",
        month_of_year="*",
    ),
    dcb_row(
        interval_id=None,
        crontab_id=1,
        minute="0",
        hour="*",
        day_of_week="*",
        day_of_month="*",
        month_of_year="*",
        timezone="Mars/Olympus",
    ),
    dcb_row(interval_id=None, solar_id=1, event="sunrise", latitude=float("nan"), longitude=0),
    dcb_row(interval_id=None, clocked_id=1, clocked_time="not a time"),
    dcb_row(priority=10**30),
]


def test_hostile_django_celery_beat_rows_are_refused_one_by_one(client: Client) -> None:
    rows = [dcb_row(name="good"), *(dict(row, name=f"d{n}") for n, row in enumerate(HOSTILE_DCB))]
    entries = django_celery_beat.entries_of(rows, app=APP)
    result = import_entries(client, entries, check_task=True)
    assert [entry.name for entry in result.added] == ["good"]
    assert len(result.skipped) == len(HOSTILE_DCB)
    for skip in result.skipped:
        assert skip.refused, skip
        one_line(skip.reason)


# -- hypothesis: any input is a valid row or a refused one -----------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
    | st.sampled_from(["t", "60", "*", "0-5", "1e300", "UTC", "Mars/Olympus", "2031-01-01"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
JOB_FIELDS = sorted(job_rows.COLUMNS)
SCHEDULE_FIELDS = [
    "name",
    "task",
    "schedule",
    "args",
    "kwargs",
    "options",
    "timezone",
    "misfire",
    "overlap",
    "catchup_window",
    "max_catchup",
    "relative",
    "paused",
    "source",
    "enabled",
]
KINDS = ["crontab", "interval", "solar", "clocked", "custom", "rrule"]


def rows_of(fields: list[str], extra: Any = None) -> st.SearchStrategy[dict[str, Any]]:
    keyed = st.dictionaries(st.sampled_from(fields), values, max_size=6)
    return keyed if extra is None else st.builds(lambda a, b: {**a, **b}, keyed, extra)


def as_json_line(row: Any) -> str:
    # NaN and infinities as JSON spells them (Python's json reads them back).
    return json.dumps(row, allow_nan=True)


ROBUST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@ROBUST
@given(
    rows=st.lists(rows_of(JOB_FIELDS, st.fixed_dictionaries({"task": st.just("t")})), max_size=4)
)
def test_any_job_row_is_valid_or_refused(rows: list[dict[str, Any]]) -> None:
    lines = [as_json_line(row) for row in rows]
    with Client(APP, settings=Settings(), store=MemoryJobStore(), staging=False) as client:
        report = job_rows.import_rows(client, job_rows.read_rows(lines, "jsonl"), chunk_size=2)
    assert report.read == len(lines)
    assert report.valid + len(report.refused) == len(lines)
    for _, reason in report.refused:
        one_line(reason)


def _schedule_spec() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda kind, more: {"kind": kind, **more},
        st.sampled_from(KINDS),
        st.dictionaries(
            st.sampled_from(
                [
                    "seconds",
                    "minute",
                    "hour",
                    "day_of_week",
                    "day_of_month",
                    "month_of_year",
                    "event",
                    "lat",
                    "lon",
                    "at",
                ]
            ),
            values,
            max_size=6,
        ),
    )


@ROBUST
@given(row=rows_of(SCHEDULE_FIELDS, st.fixed_dictionaries({"schedule": _schedule_spec()})))
def test_any_schedule_file_row_is_an_entry_or_refused(row: dict[str, Any]) -> None:
    entries = list(schedule_file.read_entries([as_json_line(row)], app=APP))
    check(entries)


@ROBUST
@given(
    definition=rows_of(
        ["name", "task", "schedule", "args", "kwargs", "options", "enabled", "last_run_at"],
        st.fixed_dictionaries(
            {
                "schedule": st.builds(
                    lambda kind, more: {"__type__": kind, **more},
                    st.sampled_from(["crontab", "interval", "datetime", "rrule"]),
                    st.dictionaries(
                        st.sampled_from(
                            [
                                "every",
                                "relative",
                                "minute",
                                "hour",
                                "year",
                                "month",
                                "day",
                                "timezone",
                            ]
                        ),
                        values,
                        max_size=5,
                    ),
                )
            }
        ),
    )
)
def test_any_redbeat_definition_is_an_entry_or_refused(definition: dict[str, Any]) -> None:
    check([redbeat.entry_of("redbeat:x", "x", as_json_line(definition), set(), APP)])


@ROBUST
@given(
    changes=st.fixed_dictionaries(
        {},
        optional={
            "every": st.integers(-(2**31), 2**31 - 1) | st.none(),
            "period": st.sampled_from(["days", "seconds", "weeks"]),
            "args": st.text(max_size=20) | values.map(as_json_line),
            "kwargs": st.text(max_size=20) | values.map(as_json_line),
            "headers": values.map(as_json_line),
            "priority": st.integers() | st.none(),
            "expire_seconds": st.integers() | st.none(),
            "queue": st.text(max_size=10) | st.none(),
            "timezone": st.text(max_size=10) | st.none(),
            "task": st.text(max_size=10),
        },
    )
)
def test_any_django_celery_beat_row_is_an_entry_or_refused(changes: dict[str, Any]) -> None:
    check(django_celery_beat.entries_of([dcb_row(**changes)], app=APP))


def check(entries: list[ScheduleEntry | Skipped]) -> None:
    """Each entry is refused with a one-line reason, or passes the import's check."""
    with Client(APP, settings=Settings(), store=MemoryJobStore(), staging=False) as client:
        result = import_entries(client, entries, dry_run=True, check_task=True)
    assert len(result.added) + len(result.skipped) == len(entries)
    for skip in result.skipped:
        one_line(skip.reason)
    for entry in result.added:
        schedule = entry.fields["schedule"]
        if isinstance(schedule, float):
            assert math.isfinite(schedule) and schedule > 0


def test_a_redbeat_crontab_that_celery_cannot_parse_is_refused_with_its_reason() -> None:
    # Celery's crontab parser raises ParseException (not a ValueError) for an
    # empty field: the import names it and goes on with the next entry.
    definition = {"name": "x", "task": "t", "schedule": {"__type__": "crontab", "minute": ""}}
    entry = redbeat.entry_of("redbeat:x", "x", as_json_line(definition), set(), APP)
    assert isinstance(entry, Skipped)
    assert "invalid crontab" in entry.reason and "empty part" in entry.reason
    one_line(entry.reason)
