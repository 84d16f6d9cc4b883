"""Every input rule of JobBuilder, and the fast encoding path's exactness."""

from __future__ import annotations

import datetime as dt
import math
import sys
import threading
import time
import uuid
import zlib
from typing import Any

import pytest
from celery import Celery
from celery.utils.saferepr import saferepr
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu.serialization import dumps, loads

from celery_sched.errors import (
    AmbiguousTime,
    InvalidArguments,
    InvalidJob,
    InvalidTime,
    NonExistentTime,
    PayloadTooLarge,
    UnknownOption,
    UnknownTask,
    UnknownTimezone,
)
from celery_sched.ids import UUID7Source
from celery_sched.models import (
    DUE_FLOOR,
    DUE_LIMIT,
    EMPTY_OPTIONS,
    MAX_SECONDS,
    NEW_JOB_ROW,
    NewJob,
)
from celery_sched.protocol import MAX_KEY_LENGTH, RESERVED_HEADERS, base_headers, is_reserved_header
from celery_sched.schedules import occurrence_key
from celery_sched.settings import Settings
from celery_sched.validation import JobBuilder, is_occurrence_key

UTC = dt.UTC
NOW = dt.datetime(2024, 6, 1, 12, 0, tzinfo=UTC)
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def make_app(**conf: Any) -> Celery:
    app = Celery("validation_tests", set_as_current=False)
    app.conf.update(timezone="America/New_York", **conf)

    @app.task(name="tests.add", shared=False)
    def add(x: int, y: int = 0) -> int:
        return x + y

    return app


def fixed_now() -> dt.datetime:
    return NOW


@pytest.fixture
def app() -> Celery:
    return make_app()


@pytest.fixture
def builder(app: Celery) -> JobBuilder:
    return JobBuilder(app, Settings())


def build(builder: JobBuilder, *args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("now", fixed_now)
    return builder.build(*args, **kwargs)


def expected_body(args: Any, kwargs: Any, serializer: str = "json") -> bytes:
    _ctype, _enc, payload = dumps((args, kwargs, EMBED), serializer=serializer)
    return payload.encode() if isinstance(payload, str) else payload


# -- task name ------------------------------------------------------------------


def test_unknown_task_is_refused_with_its_name(builder: JobBuilder) -> None:
    with pytest.raises(UnknownTask, match=r"'tests\.nope'"):
        build(builder, "tests.nope")


def test_unknown_task_accepted_when_check_disabled(builder: JobBuilder) -> None:
    job = build(builder, "elsewhere.task", [1], check_task=False)
    assert job.task == "elsewhere.task"


def test_task_registered_after_builder_creation_is_known(app: Celery) -> None:
    builder = JobBuilder(app, Settings())

    @app.task(name="tests.late")
    def late() -> None:
        return None

    assert build(builder, "tests.late").task == "tests.late"


@pytest.mark.parametrize("name", ["", None, 42])
def test_task_name_must_be_a_non_empty_string(builder: JobBuilder, name: Any) -> None:
    with pytest.raises(UnknownTask, match="non-empty string"):
        build(builder, name, check_task=False)


# -- arguments ------------------------------------------------------------------


@pytest.mark.parametrize("args", ["abc", 5, {"a": 1}, {1, 2}])
def test_args_must_be_list_or_tuple(builder: JobBuilder, args: Any) -> None:
    with pytest.raises(
        InvalidArguments, match=r"args of task 'tests\.add' must be a list or tuple"
    ):
        build(builder, "tests.add", args)


@pytest.mark.parametrize("kwargs", [[("a", 1)], "a=1", 3])
def test_kwargs_must_be_a_mapping(builder: JobBuilder, kwargs: Any) -> None:
    with pytest.raises(InvalidArguments, match="must be a mapping"):
        build(builder, "tests.add", (), kwargs)


def test_kwargs_keys_must_be_strings(builder: JobBuilder) -> None:
    with pytest.raises(InvalidArguments, match="string keys"):
        build(builder, "tests.add", (), {1: "x"})


def test_unserializable_args_name_task_and_reason(builder: JobBuilder) -> None:
    with pytest.raises(InvalidArguments) as info:
        build(builder, "tests.add", (object(),))
    message = str(info.value)
    assert "'tests.add'" in message
    assert "'json'" in message
    assert "not JSON serializable" in message


def test_payload_too_large_reports_sizes(app: Celery) -> None:
    builder = JobBuilder(app, Settings(max_payload_bytes=100))
    with pytest.raises(PayloadTooLarge) as info:
        build(builder, "tests.add", ("x" * 200,))
    size = len(expected_body(("x" * 200,), {}))
    assert f"{size} bytes" in str(info.value)
    assert "100 bytes" in str(info.value)
    # Exactly at the limit is fine.
    small = JobBuilder(app, Settings(max_payload_bytes=len(expected_body((1,), {}))))
    assert build(small, "tests.add", (1,)).body == expected_body((1,), {})


def test_payload_too_large_on_generic_path(app: Celery) -> None:
    builder = JobBuilder(app, Settings(max_payload_bytes=100))
    with pytest.raises(PayloadTooLarge):
        build(builder, "tests.add", ([list(range(100))],))


def test_body_is_protocol2_and_decodes(builder: JobBuilder) -> None:
    job = build(builder, "tests.add", [1, "two"], {"y": 3.5, "z": None})
    assert job.content_type == "application/json"
    assert job.content_encoding == "utf-8"
    assert isinstance(job.body, bytes)
    assert loads(job.body, job.content_type, job.content_encoding, accept=None) == [
        [1, "two"],
        {"y": 3.5, "z": None},
        EMBED,
    ]
    assert job.body == expected_body([1, "two"], {"y": 3.5, "z": None})


def test_nested_and_rich_arguments_use_kombu_encoder(builder: JobBuilder) -> None:
    args = ([1, {"a": [2, 3]}], uuid.UUID(int=7), dt.datetime(2024, 1, 1, tzinfo=UTC))
    kwargs = {"n": float("nan"), "when": dt.date(2024, 2, 29)}
    job = build(builder, "tests.add", args, kwargs)
    assert job.body == expected_body(args, kwargs)
    assert job.argsrepr == saferepr(args, 1024, maxlevels=3)
    assert job.kwargsrepr == saferepr(kwargs, 1024, maxlevels=3)


def test_pickle_serializer_is_used_when_configured() -> None:
    app = make_app(task_serializer="pickle", accept_content=["pickle", "json"])
    builder = JobBuilder(app, Settings())
    job = build(builder, "tests.add", (1, b"raw"), {"s": {1, 2}})
    assert job.content_type == "application/x-python-serialize"
    assert job.content_encoding == "binary"
    assert job.body == expected_body((1, b"raw"), {"s": {1, 2}}, "pickle")
    assert job.argsrepr == saferepr((1, b"raw"), 1024, maxlevels=3)


def test_reprs_truncate_like_celery(app: Celery) -> None:
    app.amqp.argsrepr_maxsize = 20
    app.amqp.kwargsrepr_maxsize = 15
    builder = JobBuilder(app, Settings())
    args = ("a" * 50, 1, 2)
    kwargs = {"long": "b" * 40}
    job = build(builder, "tests.add", args, kwargs)
    assert job.argsrepr == saferepr(args, 20, maxlevels=3)
    assert job.kwargsrepr == saferepr(kwargs, 15, maxlevels=3)
    assert len(job.argsrepr) < 40


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
)


@settings(max_examples=300, deadline=None)
@given(
    args=st.one_of(st.lists(scalars, max_size=6), st.lists(scalars, max_size=6).map(tuple)),
    kwargs=st.dictionaries(st.text(max_size=10), scalars, max_size=5),
    maxsize=st.sampled_from([8, 30, 64, 1024]),
)
def test_fast_path_matches_kombu_and_saferepr(
    args: Any, kwargs: dict[str, Any], maxsize: int
) -> None:
    app = make_app()
    app.amqp.argsrepr_maxsize = maxsize
    app.amqp.kwargsrepr_maxsize = maxsize
    builder = JobBuilder(app, Settings())
    job = build(builder, "tests.add", args, kwargs)
    assert job.body == expected_body(args, kwargs)
    # Celery's repr, with NUL escaped because PostgreSQL text cannot hold it.
    assert job.argsrepr == saferepr(args, maxsize, maxlevels=3).replace("\x00", "\\x00")
    assert job.kwargsrepr == saferepr(kwargs, maxsize, maxlevels=3).replace("\x00", "\\x00")


def test_reprs_are_storable_text(builder: JobBuilder) -> None:
    job = build(builder, "tests.add", ("a\x00b", "\udc80"), {"k": "\x00"})
    assert "\x00" not in job.argsrepr + job.kwargsrepr
    job.argsrepr.encode("utf-8")
    assert job.argsrepr == "('a\\x00b', '\\udc80')"
    assert job.kwargsrepr == "{'k': '\\x00'}"
    # The body keeps the exact values.
    assert loads(job.body, job.content_type, job.content_encoding, accept=None)[:2] == [
        ["a\x00b", "\udc80"],
        {"k": "\x00"},
    ]
    nested = build(builder, "tests.add", ([["\x00"]],))
    assert "\x00" not in nested.argsrepr


@pytest.mark.parametrize("key", ["a\x00b", "\ud800"])
def test_keys_postgres_cannot_store_are_refused(builder: JobBuilder, key: str) -> None:
    with pytest.raises(InvalidJob, match="job key"):
        build(builder, "tests.add", key=key)


def test_task_names_postgres_cannot_store_are_refused(builder: JobBuilder) -> None:
    with pytest.raises(InvalidJob, match="task name"):
        build(builder, "tests.a\x00", check_task=False)


def test_unknown_app_timezone_is_reported() -> None:
    app = make_app()
    app.conf.update(timezone="Mars/Olympus_Mons")
    with pytest.raises(UnknownTimezone, match="Mars/Olympus_Mons"):
        JobBuilder(app, Settings())


# -- due time --------------------------------------------------------------------


def test_eta_and_countdown_together_are_refused(builder: JobBuilder) -> None:
    with pytest.raises(InvalidTime, match="not both"):
        build(builder, "tests.add", eta=NOW, countdown=5)


def test_no_due_time_means_now_from_the_given_clock(builder: JobBuilder) -> None:
    assert build(builder, "tests.add").due_at == NOW


def test_countdown_adds_to_the_clock(builder: JobBuilder) -> None:
    assert build(builder, "tests.add", countdown=90).due_at == NOW + dt.timedelta(seconds=90)
    assert build(builder, "tests.add", countdown=0.5).due_at == NOW + dt.timedelta(seconds=0.5)
    assert build(builder, "tests.add", countdown=0).due_at == NOW


def test_clock_is_not_read_when_eta_is_given(builder: JobBuilder) -> None:
    def no_clock() -> dt.datetime:
        raise AssertionError("clock read")

    assert build(builder, "tests.add", eta=NOW, now=no_clock).due_at == NOW


@pytest.mark.parametrize("countdown", [-1, -0.001, math.nan, math.inf, True, "10", [1]])
def test_bad_countdowns(builder: JobBuilder, countdown: Any) -> None:
    with pytest.raises(InvalidTime, match="countdown"):
        build(builder, "tests.add", countdown=countdown)


def test_aware_eta_is_converted_to_utc(builder: JobBuilder) -> None:
    tokyo = dt.timezone(dt.timedelta(hours=9))
    job = build(builder, "tests.add", eta=dt.datetime(2024, 6, 1, 21, 0, tzinfo=tokyo))
    assert job.due_at == NOW
    assert job.due_at.utcoffset() == dt.timedelta(0)


def test_naive_eta_is_read_in_the_app_timezone(builder: JobBuilder) -> None:
    # New York is UTC-4 in summer, UTC-5 in winter.
    assert build(builder, "tests.add", eta=dt.datetime(2024, 6, 1, 8, 0)).due_at == NOW
    winter = build(builder, "tests.add", eta=dt.datetime(2024, 1, 15, 7, 0)).due_at
    assert winter == dt.datetime(2024, 1, 15, 12, 0, tzinfo=UTC)


def test_naive_eta_in_utc_app() -> None:
    app = Celery("utc", set_as_current=False)
    builder = JobBuilder(app, Settings())
    job = builder.build("x", eta=dt.datetime(2024, 6, 1, 12, 0), check_task=False, now=fixed_now)
    assert job.due_at == NOW


def test_eta_in_dst_gap_is_refused(builder: JobBuilder) -> None:
    with pytest.raises(NonExistentTime):
        build(builder, "tests.add", eta=dt.datetime(2024, 3, 10, 2, 30))


def test_eta_in_dst_overlap_is_refused(builder: JobBuilder) -> None:
    with pytest.raises(AmbiguousTime):
        build(builder, "tests.add", eta=dt.datetime(2024, 11, 3, 1, 30))


def test_eta_as_iso_string(builder: JobBuilder) -> None:
    assert build(builder, "tests.add", eta="2024-06-01T12:00:00+00:00").due_at == NOW
    with pytest.raises(InvalidTime, match="ISO 8601"):
        build(builder, "tests.add", eta="tomorrow")


@pytest.mark.parametrize("eta", [dt.date(2024, 6, 1), 1717243200, 12.5])
def test_eta_must_be_a_datetime(builder: JobBuilder, eta: Any) -> None:
    with pytest.raises(InvalidTime, match="eta must be a datetime"):
        build(builder, "tests.add", eta=eta)


# -- options ---------------------------------------------------------------------


def test_unknown_options_are_listed(builder: JobBuilder) -> None:
    with pytest.raises(UnknownOption) as info:
        build(builder, "tests.add", options={"queue": "q", "retry": True, "link": "x"})
    assert "link, retry" in str(info.value)
    assert "queue," not in str(info.value).split(";")[0]


def test_message_options_are_kept(builder: JobBuilder) -> None:
    options = {
        "queue": "fast",
        "exchange": "",
        "routing_key": "fast.rk",
        "priority": 9,
        "headers": {"tenant": "a"},
        "time_limit": 30,
        "soft_time_limit": 20.5,
        "ignore_result": True,
        "compression": "zlib",
    }
    job = build(builder, "tests.add", options=options)
    assert dict(job.options) == {**options, "time_limit": 30.0}


def test_none_valued_options_are_ignored(builder: JobBuilder) -> None:
    job = build(builder, "tests.add", options={"queue": None, "expires": None, "max_runtime": None})
    assert dict(job.options) == {}
    assert job.expires_at is None
    assert job.max_runtime is None


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("priority", 256),
        ("priority", -1),
        ("priority", True),
        ("priority", 1.0),
        ("queue", ""),
        ("queue", 5),
        ("routing_key", 2),
        ("headers", {"x": object()}),
        ("headers", {1: "a"}),
        ("headers", ["a"]),
        ("headers", {"x": "nul\x00"}),
        ("queue", "q\x00"),
        ("time_limit", 0),
        ("soft_time_limit", -5),
        ("time_limit", math.inf),
        ("ignore_result", "yes"),
        ("compression", "nope"),
        ("compression", ["zlib"]),
        ("max_attempts", 0),
        ("max_attempts", 2.0),
        ("visibility_timeout", 0),
        ("visibility_timeout", "30"),
        ("max_runtime", -1),
        ("max_runtime", math.nan),
    ],
)
def test_bad_option_values(builder: JobBuilder, name: str, value: Any) -> None:
    with pytest.raises(InvalidJob, match=name):
        build(builder, "tests.add", options={name: value})


def test_job_options_shape_the_row(builder: JobBuilder) -> None:
    job = build(
        builder,
        "tests.add",
        options={"max_attempts": 2, "visibility_timeout": 45, "max_runtime": 600},
    )
    assert (job.max_attempts, job.visibility_timeout, job.max_runtime) == (2, 45.0, 600.0)
    assert dict(job.options) == {}


def test_default_max_attempts_comes_from_settings(app: Celery) -> None:
    builder = JobBuilder(app, Settings(max_attempts=9))
    assert build(builder, "tests.add").max_attempts == 9
    assert build(builder, "tests.add", options={"queue": "q"}).max_attempts == 9


def test_expires_in_seconds_counts_from_the_due_time(builder: JobBuilder) -> None:
    job = build(builder, "tests.add", countdown=60, options={"expires": 30})
    assert job.expires_at == NOW + dt.timedelta(seconds=90)


def test_expires_as_datetime(builder: JobBuilder) -> None:
    aware = build(builder, "tests.add", options={"expires": NOW + dt.timedelta(hours=1)})
    assert aware.expires_at == NOW + dt.timedelta(hours=1)
    naive = build(builder, "tests.add", options={"expires": dt.datetime(2024, 6, 1, 9, 0)})
    assert naive.expires_at == NOW + dt.timedelta(hours=1)  # 09:00 New York = 13:00Z


def test_the_tasks_expires_counts_from_the_due_time_unless_the_job_gives_its_own(
    app: Celery,
) -> None:
    """Issue 15, point 4: ``@app.task(expires=20)`` reached workers as
    ``expires=None``. A one-off job keeps the documented rule: seconds
    after its due time, fixed in ``expires_at`` for the store."""

    @app.task(name="tests.expiring", shared=False, expires=20)
    def expiring() -> None:
        return None

    builder = JobBuilder(app, Settings())
    job = build(builder, "tests.expiring", countdown=60)
    assert job.expires_at == NOW + dt.timedelta(seconds=80)
    assert dict(job.options) == {}  # a row field, not a message option
    own = build(builder, "tests.expiring", countdown=60, options={"expires": 5, "queue": "q"})
    assert own.expires_at == NOW + dt.timedelta(seconds=65)
    assert build(builder, "tests.add", countdown=60).expires_at is None


@pytest.mark.parametrize(
    "expires", [0, -5, math.nan, NOW, NOW - dt.timedelta(seconds=1), True, "soon"]
)
def test_expires_at_or_before_due_is_refused(builder: JobBuilder, expires: Any) -> None:
    with pytest.raises(InvalidTime, match="expires"):
        build(builder, "tests.add", options={"expires": expires})


# -- key, id, shard --------------------------------------------------------------


def test_generated_key_is_the_job_id(builder: JobBuilder) -> None:
    job = build(builder, "tests.add")
    assert job.key == str(job.id)
    assert job.id.version == 7


def test_ids_are_unique_time_ordered_uuid7(builder: JobBuilder) -> None:
    before_ms = time.time_ns() // 1_000_000
    ids = [build(builder, "tests.add").id for _ in range(5000)]
    after_ms = time.time_ns() // 1_000_000
    assert len(set(ids)) == 5000
    assert all(i.version == 7 and i.variant == uuid.RFC_4122 for i in ids)
    # RFC 9562: the top 48 bits are the Unix time in milliseconds, so ids
    # from later milliseconds sort after earlier ones (index locality).
    stamps = [i.int >> 80 for i in ids]
    assert all(before_ms <= stamp <= after_ms for stamp in stamps)
    assert stamps == sorted(stamps)
    # 74 random bits: no two ids of one millisecond share them.
    assert len({i.int & ((1 << 80) - 1) for i in ids}) == 5000
    # Built objects behave like ordinary UUIDs.
    assert uuid.UUID(str(ids[0])) == ids[0]
    assert hash(uuid.UUID(str(ids[0]))) == hash(ids[0])


def test_ids_drawn_from_many_threads_at_once_are_unique() -> None:
    """One source serves every thread of a process (a Client shared by a web
    app's threads): no two calls may get the same random bits."""
    source = UUID7Source()
    per_thread = 20_000
    start = threading.Barrier(8)
    drawn: list[list[uuid.UUID]] = []

    def draw() -> None:
        start.wait()
        drawn.append([source.next() for _ in range(per_thread)])

    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        threads = [threading.Thread(target=draw) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(0.005)
    ids = [i for batch in drawn for i in batch]
    assert len(ids) == 8 * per_thread
    assert len({i.int & ((1 << 80) - 1) for i in ids}) == len(ids)


def test_given_key_is_kept(builder: JobBuilder) -> None:
    job = build(builder, "tests.add", key="report:2024-06")
    assert job.key == "report:2024-06"
    assert build(builder, "tests.add", key="k" * MAX_KEY_LENGTH).key == "k" * MAX_KEY_LENGTH


@pytest.mark.parametrize("key", ["", "k" * (MAX_KEY_LENGTH + 1), 5, b"bytes"])
def test_bad_keys(builder: JobBuilder, key: Any) -> None:
    with pytest.raises(InvalidJob, match="key"):
        build(builder, "tests.add", key=key)


def test_shard_is_crc32_of_key(app: Celery) -> None:
    builder = JobBuilder(app, Settings(shards=7))
    for key in ["a", "b", "report:2024", "ünïcode"]:
        job = build(builder, "tests.add", key=key)
        assert job.shard == zlib.crc32(key.encode()) % 7
        assert builder.shard_of(key) == job.shard
    shards = {build(builder, "tests.add").shard for _ in range(300)}
    assert shards == set(range(7))


def test_single_shard_is_zero(builder: JobBuilder) -> None:
    assert {build(builder, "tests.add").shard for _ in range(50)} == {0}


# -- the bulk row path -------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_options = st.fixed_dictionaries(
    {},
    optional={
        "queue": st.sampled_from(["a", "celery"]),
        "priority": st.integers(0, 255),
        "max_attempts": st.integers(1, 9),
        "expires": st.floats(1, 1e6),
        # NUL and reserved names are refused by validation: tested elsewhere.
        "headers": st.dictionaries(
            st.text(max_size=4).filter(lambda k: "\x00" not in k and not is_reserved_header(k)),
            _scalars.filter(lambda v: not (isinstance(v, str) and "\x00" in v)),
            max_size=2,
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(
    args=st.lists(st.one_of(_scalars, st.lists(_scalars, max_size=2)), max_size=4),
    kwargs=st.dictionaries(st.text(max_size=5), _scalars, max_size=3),
    offset=st.integers(-(10**6), 10**8),
    key=st.one_of(st.none(), st.text(min_size=1, max_size=20).filter(lambda k: "\x00" not in k)),
    options=_options,
)
def test_bulk_row_equals_the_validated_new_job(
    args: list[Any], kwargs: dict[str, Any], offset: int, key: str | None, options: dict[str, Any]
) -> None:
    """build_row's tuple holds exactly what build() validates into a NewJob."""
    builder = JobBuilder(make_app(), Settings())
    eta = NOW + dt.timedelta(microseconds=offset)
    row_input = {"task": "tests.add", "args": args, "kwargs": kwargs, "eta": eta, **options}
    if key is not None:
        row_input["key"] = key
    fields = frozenset({"task", "args", "kwargs", "eta", "key"})
    row = builder.build_row(row_input, fixed_now, fields)
    job = build(builder, "tests.add", args, kwargs, eta=eta, key=key, options=options)
    expected = job.as_row()
    assert len(row) == len(NEW_JOB_ROW)
    # Ids are drawn per call; everything else, including the due bucket, agrees.
    assert row[2:] == expected[2:]
    assert row[NEW_JOB_ROW.index("due_bucket")] == job.due_bucket
    if key is None:
        # The key is the id: the row leaves it out, NewJob spells it out.
        assert row[1] is None
        assert NewJob.from_row(row).key == str(row[0])
    else:
        assert row[1] == key
    # And a NewJob rebuilt from the row passes NewJob's own validation unchanged.
    rebuilt = NewJob.from_row(row)
    assert rebuilt.as_row() == (row[0], rebuilt.key, *row[2:])
    assert isinstance(rebuilt.options, dict)


@pytest.mark.parametrize("form", ["canonical", "upper", "braces"])
def test_a_key_that_is_a_uuids_text_becomes_the_job_id(builder: JobBuilder, form: str) -> None:
    """Only the canonical text (``str(uuid)``) is the id; other spellings are
    ordinary keys, with ids of their own."""
    value = uuid.uuid4()
    key = {"canonical": str(value), "upper": str(value).upper(), "braces": f"{{{value}}}"}[form]
    job = builder.build("tests.add", [1], key=key, now=fixed_now)
    fields = frozenset({"task", "key"})
    row = builder.build_row({"task": "tests.add", "key": key}, fixed_now, fields)
    assert job.key == key
    if form == "canonical":
        # The row keeps the caller's key beside the id it became: the bulk
        # load then knows the id is the caller's and checks it is free (0012).
        assert (job.id, row[0], row[1]) == (value, value, key)
    else:
        assert job.id != value and row[0] != value and row[1] == key
        assert job.id.version == 7


def test_bulk_row_without_options_shares_the_read_only_empty_mapping(builder: JobBuilder) -> None:
    row = builder.build_row(
        {"task": "tests.add", "args": [1]}, fixed_now, frozenset({"task", "args"})
    )
    assert row[NEW_JOB_ROW.index("options")] is EMPTY_OPTIONS
    with pytest.raises(TypeError):
        row[NEW_JOB_ROW.index("options")]["queue"] = "x"  # type: ignore[index]
    # NewJobs never share it.
    assert NewJob.from_row(row).options == {} and NewJob.from_row(row).options is not EMPTY_OPTIONS


# -- values the store cannot hold (issue 13, defects 6 and 11) ------------------------

ROW_FIELDS = frozenset({"task", "args", "kwargs", "eta", "countdown", "key"})


def test_the_due_limit_is_the_end_of_the_int32_minute_bucket() -> None:
    assert dt.datetime(1970, 1, 1, tzinfo=UTC) + dt.timedelta(minutes=2**31) == DUE_LIMIT
    assert DUE_LIMIT.year == 6053


@pytest.mark.parametrize(
    "eta",
    [
        DUE_LIMIT,
        DUE_LIMIT + dt.timedelta(days=1),
        dt.datetime(9999, 12, 31, 23, 59, tzinfo=UTC),
        "7000-01-01T00:00:00+00:00",
    ],
)
def test_a_due_time_past_the_bucket_range_is_refused_on_both_paths(
    builder: JobBuilder, eta: Any
) -> None:
    """Before: build() made a row whose due_bucket overflowed int32 (StoreError
    at insert) and build_row() a negative-or-wrapped bucket stored silently."""
    with pytest.raises(InvalidTime, match=r"too late.*6053"):
        build(builder, "tests.add", eta=eta)
    with pytest.raises(InvalidTime, match=r"too late.*6053"):
        builder.build_row({"task": "tests.add", "eta": eta}, fixed_now, ROW_FIELDS)
    with pytest.raises(InvalidTime, match="too late"):
        builder.build_row({"task": "tests.add", "eta": eta, "queue": "q"}, fixed_now, ROW_FIELDS)


def test_a_countdown_past_the_bucket_range_is_refused(builder: JobBuilder) -> None:
    seconds = (DUE_LIMIT - NOW).total_seconds()
    with pytest.raises(InvalidTime, match="too late"):
        build(builder, "tests.add", countdown=seconds)
    with pytest.raises(InvalidTime, match="too late"):
        builder.build_row({"task": "tests.add", "countdown": seconds}, fixed_now, ROW_FIELDS)


@pytest.mark.parametrize(
    "eta",
    [
        dt.datetime(500, 10, 1, tzinfo=UTC),
        DUE_FLOOR - dt.timedelta(microseconds=1),
        "1970-01-01T00:00:00Z",
        dt.datetime(1999, 12, 31, 18, 59),  # naive: New York, a minute before the floor
    ],
)
def test_a_due_time_before_2000_is_refused_on_both_paths(builder: JobBuilder, eta: Any) -> None:
    """Before: accepted; year 500 made a partition whose name broke every
    later write (#30, finding 2)."""
    with pytest.raises(InvalidTime, match=r"too early: due times before 2000-01-01T00:00:00\+00"):
        build(builder, "tests.add", eta=eta)
    with pytest.raises(InvalidTime, match="too early"):
        builder.build_row({"task": "tests.add", "eta": eta}, fixed_now, ROW_FIELDS)


def test_the_due_floor_itself_is_accepted(builder: JobBuilder) -> None:
    assert build(builder, "tests.add", eta=DUE_FLOOR).due_at == DUE_FLOOR
    row = builder.build_row({"task": "tests.add", "eta": DUE_FLOOR}, fixed_now, ROW_FIELDS)
    assert row[NEW_JOB_ROW.index("due_at")] == DUE_FLOOR


def test_the_last_storable_due_time_is_accepted(builder: JobBuilder) -> None:
    last = DUE_LIMIT - dt.timedelta(microseconds=1)
    assert build(builder, "tests.add", eta=last).due_bucket == 2**31 - 1
    row = builder.build_row({"task": "tests.add", "eta": last}, fixed_now, ROW_FIELDS)
    assert row[NEW_JOB_ROW.index("due_bucket")] == 2**31 - 1


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_attempts", 2**31),
        ("visibility_timeout", 1e300),
        ("max_runtime", MAX_SECONDS * 2),
        ("time_limit", 1e300),
        ("soft_time_limit", 1e20),
        ("expires", 1e300),
        ("expires", MAX_SECONDS + 1),
    ],
)
def test_values_that_cannot_be_stored_or_computed_with_are_refused(
    builder: JobBuilder, name: str, value: Any
) -> None:
    """Before: max_attempts 2**31 overflowed the integer column (StoreError),
    and a visibility_timeout of 1e300 was stored, then failed every reconcile
    (an interval off now() out of range)."""
    with pytest.raises(InvalidJob, match=name):
        build(builder, "tests.add", options={name: value})
    with pytest.raises(InvalidJob, match=name):
        builder.build_row({"task": "tests.add", name: value}, fixed_now, ROW_FIELDS)


def test_the_largest_values_are_accepted(builder: JobBuilder) -> None:
    job = build(
        builder,
        "tests.add",
        options={"max_attempts": 2**31 - 1, "visibility_timeout": MAX_SECONDS, "expires": 1e9},
    )
    assert job.max_attempts == 2**31 - 1 and job.visibility_timeout == MAX_SECONDS


# -- reserved headers (issue 13, defect 10) ------------------------------------------


def test_reserved_headers_cover_celerys_protocol_and_our_own(app: Celery) -> None:
    message = app.amqp.as_task_v2("id", "tests.add", (), {})
    assert set(message.headers) <= RESERVED_HEADERS
    ours = base_headers(origin="o", epoch=1)
    assert all(is_reserved_header(name) for name in ours)
    assert is_reserved_header("celery_sched_failures")  # celery_sched.Task's retry count
    assert is_reserved_header("celery_sched_anything_added_later")
    assert not is_reserved_header("tenant") and not is_reserved_header("celery_schedX")


_RESERVED_SAMPLES = [
    *sorted(RESERVED_HEADERS),
    "celery_sched_key",
    "celery_sched_attempt",
    "celery_sched_epoch",
    "celery_sched_failures",
    "celery_sched_future",
]


@pytest.mark.parametrize("name", _RESERVED_SAMPLES)
def test_headers_option_may_not_set_a_reserved_name(builder: JobBuilder, name: str) -> None:
    """Before: accepted, and the header replaced the protocol field in the message."""
    headers = {"tenant": "a", name: 1}
    with pytest.raises(InvalidJob, match=f"must not set '{name}'.*reserved"):
        build(builder, "tests.add", options={"headers": headers})
    with pytest.raises(InvalidJob, match=f"must not set '{name}'"):
        builder.build_row({"task": "tests.add", "headers": headers}, fixed_now, ROW_FIELDS)


def test_headers_option_with_other_names_is_kept(builder: JobBuilder) -> None:
    job = build(builder, "tests.add", options={"headers": {"tenant": "a", "eta_hint": 1}})
    assert dict(job.options["headers"]) == {"tenant": "a", "eta_hint": 1}


# -- caller keys shaped like occurrence keys (issue 13, item 13) ---------------------


@settings(max_examples=200, deadline=None)
@given(
    name=st.text(min_size=1, max_size=12).filter(lambda n: n.strip()),
    nominal=st.datetimes(
        min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31), timezones=st.just(UTC)
    ),
)
def test_every_key_the_planner_writes_has_the_reserved_form(
    name: str, nominal: dt.datetime
) -> None:
    assert is_occurrence_key(occurrence_key(name, nominal))


@pytest.mark.parametrize(
    "key",
    [
        "nightly@2026-12-04T00:00:00Z",
        "nightly@2026-12-04T00:00:00.000001Z",
        "a@b@0001-01-01T00:00:00Z",
        "report:eu@2030-06-30T23:59:59Z",
        "x@9999-12-31T23:59:59.999999Z",
    ],
)
def test_a_caller_key_shaped_like_an_occurrence_key_is_refused(
    builder: JobBuilder, key: str
) -> None:
    """Before: accepted; the planner then skipped that occurrence, since its key existed."""
    with pytest.raises(InvalidJob, match="reserved for the occurrences of periodic schedules"):
        build(builder, "tests.add", key=key, caller_key=True)
    with pytest.raises(InvalidJob, match="reserved for the occurrences"):
        builder.build_row({"task": "tests.add", "key": key}, fixed_now, ROW_FIELDS)
    # The planner's own sample occurrence (caller_key left False) still builds.
    assert build(builder, "tests.add", key=key).key == key


@pytest.mark.parametrize(
    "key",
    [
        "nightly@2026-12-04",
        "nightly@2026-12-04T00:00:00",
        "nightly@2026-12-04T00:00:00+00:00",
        "nightly@2026-12-04T00:00Z",
        "nightly@2026-12-04T00:00:00.5Z",
        "nightly@2026-12-04 00:00:00Z",
        "@2026-12-04T00:00:00Z",
        "nightly-2026-12-04T00:00:00Z",
        "nightly@2026-12-04T00:00:00Zx",
    ],
)
def test_keys_near_the_occurrence_form_are_accepted(builder: JobBuilder, key: str) -> None:
    assert build(builder, "tests.add", key=key, caller_key=True).key == key
    row = builder.build_row({"task": "tests.add", "key": key}, fixed_now, ROW_FIELDS)
    assert row[1] == key
