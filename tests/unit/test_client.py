"""The Client API on the in-memory store: writes, refusals that write nothing,
all-or-nothing bulk scheduling."""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_sched.client import Client
from celery_sched.errors import (
    DuplicateJob,
    InvalidArguments,
    InvalidJob,
    InvalidSchedule,
    InvalidTime,
    PayloadTooLarge,
    StagingUnavailable,
    UndecodableBody,
    UnknownOption,
    UnknownTask,
    UntrustedContent,
)
from celery_sched.models import DUE_LIMIT, MAX_SECONDS, Job, JobStatus
from celery_sched.schedules import clocked
from celery_sched.settings import Settings
from celery_sched.staging.memory import MemoryStaging
from celery_sched.store.memory import MemoryJobStore

UTC = dt.UTC
T0 = dt.datetime(2024, 6, 1, 12, 0, tzinfo=UTC)


class Clock:
    def __init__(self, now: dt.datetime) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> dt.datetime:
        self.reads += 1
        return self.now


@pytest.fixture
def app() -> Celery:
    app = Celery("client_tests", set_as_current=False)
    app.conf.update(timezone="Europe/London")

    @app.task(name="tests.add", shared=False)
    def add(x: int, y: int = 0) -> int:
        return x + y

    return app


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def store(clock: Clock) -> MemoryJobStore:
    return MemoryJobStore(clock=clock)


@pytest.fixture
def staging() -> MemoryStaging:
    return MemoryStaging()


@pytest.fixture
def client(app: Celery, store: MemoryJobStore, staging: MemoryStaging) -> Client:
    return Client(app, settings=Settings(max_payload_bytes=1000), store=store, staging=staging)


def nothing_written(store: MemoryJobStore) -> bool:
    return store.counts_by_status() == {}


# -- schedule ----------------------------------------------------------------------


def test_schedule_stores_a_pending_job(client: Client) -> None:
    job = client.schedule("tests.add", (2, 3), {"y": 1}, countdown=60, key="k1", queue="q")
    assert job.status is JobStatus.PENDING
    assert job.due_at == T0 + dt.timedelta(seconds=60)
    assert job.created_at == T0
    assert job.attempt == 0
    assert (job.args, job.kwargs) == ((2, 3), {"y": 1})
    assert dict(job.options) == {"queue": "q"}
    assert client.get("k1") == job


def test_schedule_due_now_uses_store_clock(client: Client, clock: Clock) -> None:
    clock.now = T0 + dt.timedelta(days=3)
    assert client.schedule("tests.add", (1,)).due_at == clock.now


def test_naive_eta_uses_app_timezone(client: Client) -> None:
    job = client.schedule("tests.add", (1,), eta=dt.datetime(2024, 6, 1, 13, 0))
    assert job.due_at == T0  # 13:00 BST is 12:00 UTC


def test_get_unknown_key_is_none(client: Client) -> None:
    assert client.get("missing") is None


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c: c.schedule("tests.nope", (1,)), UnknownTask),
        (lambda c: c.schedule("tests.add", "1"), InvalidArguments),
        (lambda c: c.schedule("tests.add", (), ["x"]), InvalidArguments),
        (lambda c: c.schedule("tests.add", (object(),)), InvalidArguments),
        (lambda c: c.schedule("tests.add", ("x" * 2000,)), PayloadTooLarge),
        (lambda c: c.schedule("tests.add", eta=T0, countdown=1), InvalidTime),
        (lambda c: c.schedule("tests.add", countdown=-1), InvalidTime),
        (lambda c: c.schedule("tests.add", eta=dt.datetime(2024, 3, 31, 1, 30)), InvalidTime),
        (lambda c: c.schedule("tests.add", eta=dt.datetime(2024, 10, 27, 1, 30)), InvalidTime),
        (lambda c: c.schedule("tests.add", retries=3), UnknownOption),
        (lambda c: c.schedule("tests.add", priority=300), InvalidJob),
        (lambda c: c.schedule("tests.add", expires=-1), InvalidTime),
        (lambda c: c.schedule("tests.add", key=""), InvalidJob),
        (lambda c: c.schedule("tests.add", if_exists="ignore"), InvalidJob),
    ],
)
def test_bad_input_writes_nothing(
    client: Client, store: MemoryJobStore, call: Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        call(client)
    assert nothing_written(store)


def test_duplicate_key_raises_or_returns_existing(client: Client, clock: Clock) -> None:
    first = client.schedule("tests.add", (1,), key="dup")
    clock.now = T0 + dt.timedelta(hours=1)
    with pytest.raises(DuplicateJob, match="'dup'") as info:
        client.schedule("tests.add", (2,), key="dup")
    assert info.value.key == "dup"
    again = client.schedule("tests.add", (2,), key="dup", if_exists="return")
    assert again == first
    assert again.args == (1,)
    assert client.counts_by_status() == {JobStatus.PENDING: 1}


# -- cancel ------------------------------------------------------------------------


def test_cancel_only_pending_jobs(client: Client, store: MemoryJobStore) -> None:
    client.schedule("tests.add", (1,), key="a")
    client.schedule("tests.add", (1,), key="b")
    assert client.cancel("a") is True
    assert client.get("a").status is JobStatus.CANCELLED  # type: ignore[union-attr]
    assert client.cancel("a") is False
    assert client.cancel("missing") is False
    epoch = store.acquire_epoch(0, "test")
    store.claim_due(shard=0, epoch=epoch, limit=10)
    assert client.cancel("b") is False
    assert client.get("b").status is JobStatus.DISPATCHED  # type: ignore[union-attr]


# -- schedule_many -------------------------------------------------------------------


def rows(n: int, **extra: Any) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"task": "tests.add", "args": [i], "key": f"bulk-{i}", **extra}


def test_schedule_many_writes_every_row(client: Client) -> None:
    count = client.schedule_many(rows(50, countdown=30, queue="bulk"))
    assert count == 50
    job = client.get("bulk-7")
    assert job is not None
    assert job.args == (7,)
    assert job.due_at == T0 + dt.timedelta(seconds=30)
    assert dict(job.options) == {"queue": "bulk"}
    assert client.counts_by_status() == {JobStatus.PENDING: 50}


def test_schedule_many_accepts_task_name_and_mixed_rows(client: Client) -> None:
    count = client.schedule_many(
        [
            {"task_name": "tests.add", "args": (1,)},
            {"task": "tests.add", "kwargs": {"x": 1}, "eta": T0 + dt.timedelta(hours=2)},
            {"task": "other.task", "check_task": False, "expires": 10, "max_attempts": 2},
        ]
    )
    assert count == 3
    by_hour = client.counts_by_hour()
    assert by_hour == {T0: 2, T0 + dt.timedelta(hours=2): 1}


def test_schedule_many_reads_store_clock_once(client: Client, clock: Clock) -> None:
    client.schedule_many(rows(20))
    assert clock.reads <= 2  # the batch's "now" plus the store's created_at


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ({"task": "tests.nope"}, UnknownTask),
        ({"task": "tests.add", "args": "x"}, InvalidArguments),
        ({"task": "tests.add", "bogus": 1}, UnknownOption),
        ({"task": "tests.add", "countdown": "soon"}, InvalidTime),
        ({"args": [1]}, UnknownTask),
        ("not a mapping", InvalidJob),
    ],
)
def test_schedule_many_bad_row_writes_nothing(
    client: Client, store: MemoryJobStore, bad: Any, error: type[Exception]
) -> None:
    batch: list[Any] = list(rows(10))
    batch.insert(6, bad)
    with pytest.raises(error, match=r"^row 6: "):
        client.schedule_many(batch)
    assert nothing_written(store)


def test_schedule_many_duplicate_in_batch_writes_nothing(
    client: Client, store: MemoryJobStore
) -> None:
    batch = [*rows(5), {"task": "tests.add", "key": "bulk-2"}]
    with pytest.raises(DuplicateJob):
        client.schedule_many(batch)
    assert nothing_written(store)


def test_schedule_many_duplicate_of_stored_key_writes_nothing(client: Client) -> None:
    client.schedule("tests.add", key="bulk-3")
    with pytest.raises(DuplicateJob):
        client.schedule_many(rows(10))
    assert client.counts_by_status() == {JobStatus.PENDING: 1}


def test_schedule_many_consumes_lazily_and_reraises_source_errors(
    client: Client, store: MemoryJobStore
) -> None:
    seen: list[int] = []

    class SourceBroke(Exception):
        pass

    def source() -> Iterator[dict[str, Any]]:
        for i in range(10):
            seen.append(i)
            if i == 4:
                raise SourceBroke("disk gone")
            yield {"task": "tests.add", "args": [i]}

    with pytest.raises(SourceBroke, match="disk gone"):
        client.schedule_many(source())
    assert seen == [0, 1, 2, 3, 4]
    assert nothing_written(store)


def test_schedule_many_empty(client: Client) -> None:
    assert client.schedule_many([]) == 0


# -- lifecycle ------------------------------------------------------------------------


def test_injected_store_is_not_closed(app: Celery, store: MemoryJobStore) -> None:
    with Client(app, settings=Settings(), store=store, staging=False) as client:
        client.schedule("tests.add", (1,), key="x")
    assert store.get("x") is not None
    assert store._closed is False


def test_store_is_built_lazily_from_settings(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[Settings] = []
    memory = MemoryJobStore()

    def fake_build_store(settings: Settings) -> MemoryJobStore:
        built.append(settings)
        return memory

    monkeypatch.setattr("celery_sched.backends.build_store", fake_build_store)
    settings = Settings(db_schema="lazy")
    client = Client(app, settings=settings, staging=False)
    assert built == []
    client.schedule("tests.add", (1,), key="lazy")
    assert built == [settings]
    client.close()
    assert memory._closed is True


def test_settings_default_to_the_app_conf(app: Celery) -> None:
    app.conf.celery_sched_max_attempts = 3
    client = Client(app, store=MemoryJobStore(), staging=False)
    assert client.settings.max_attempts == 3
    assert client.schedule("tests.add").max_attempts == 3


# -- staging of jobs due soon ------------------------------------------------------


class DownStaging(MemoryStaging):
    def add(self, shard: int, items: Any) -> int:
        raise StagingUnavailable("redis is down (test)")


def test_a_job_due_within_the_window_is_staged_at_once(
    client: Client, staging: MemoryStaging
) -> None:
    now = dt.datetime.now(dt.UTC)
    soon = client.schedule("tests.add", (1,), eta=now + dt.timedelta(seconds=5))
    client.schedule("tests.add", (2,), eta=now + dt.timedelta(hours=2))
    assert staging.size(0) == 1
    assert staging.pop_due(0, soon.due_at, 10) == [soon.id]


def test_schedule_many_stages_only_the_jobs_due_soon(
    client: Client, staging: MemoryStaging
) -> None:
    now = dt.datetime.now(dt.UTC)
    rows = [
        {"task": "tests.add", "args": (i,), "eta": now + dt.timedelta(seconds=i * 20)}
        for i in range(10)
    ]
    assert client.schedule_many(rows) == 10
    # The default window is 60 s: offsets 0, 20, 40 and 60 s.
    assert staging.size(0) == 4


def test_staging_failure_never_fails_scheduling(
    app: Celery, store: MemoryJobStore, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(app, settings=Settings(), store=store, staging=DownStaging())
    job = client.schedule("tests.add", (1,))
    assert store.get(job.key) is not None
    assert "could not stage" in caplog.text


def test_staging_false_never_builds_a_redis_client(
    app: Celery, store: MemoryJobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_redis(settings: Settings) -> None:
        raise AssertionError("staging must not be built")

    monkeypatch.setattr("celery_sched.backends.build_staging", no_redis)
    client = Client(app, settings=Settings(), store=store, staging=False)
    client.schedule("tests.add", (1,))
    client.schedule_many([{"task": "tests.add"}])
    assert store.counts_by_status() == {JobStatus.PENDING: 2}


def test_schedule_many_measures_the_window_from_the_commit(
    client: Client, staging: MemoryStaging, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The insert takes a while; the leader's stager meanwhile moved its
    # horizon. Jobs that entered the window during the insert are staged.
    start = dt.datetime.now(dt.UTC)
    horizons = iter([start + dt.timedelta(seconds=60), start + dt.timedelta(seconds=90)])
    monkeypatch.setattr(client, "_staging_horizon", lambda: next(horizons))
    rows = [
        {"task": "tests.add", "eta": start + dt.timedelta(seconds=s), "key": f"k{s}"}
        for s in (30, 75, 600)
    ]
    client.schedule_many(rows)
    staged = staging.pop_due(0, start + dt.timedelta(hours=1), 10)
    keys = {job.key for job in (client.store.get_by_id(i) for i in staged) if job}
    assert keys == {"k30", "k75"}


# -- bodies decoded with the app's accept_content (issue 13, defect 8) ---------------

PICKLE = "application/x-python-serialize"


def pickle_app(accept: list[str]) -> Celery:
    app = Celery("pickle_tests", set_as_current=False)
    app.conf.update(task_serializer="pickle", accept_content=accept)

    @app.task(name="tests.rich", shared=False)
    def rich(*args: Any, **kwargs: Any) -> None:
        """Takes what only pickle carries."""

    return app


UNPICKLED: list[str] = []


def record_unpickling(tag: str) -> None:
    UNPICKLED.append(tag)


class Boom:
    """Unpickling it records a call: proof that a body was deserialized."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (record_unpickling, ("unpickled",))


@pytest.fixture
def insecure_serializers_enabled() -> Iterator[None]:
    """What a process that ever enabled pickle (a worker with
    accept_content=['pickle']) looks like to kombu: pickle is no longer disabled."""
    from kombu import serialization

    saved = set(serialization.registry._disabled_content_types)
    serialization.enable_insecure_serializers()
    try:
        yield
    finally:
        serialization.registry._disabled_content_types.clear()
        serialization.registry._disabled_content_types.update(saved)


def test_a_pickle_app_reads_back_its_job_and_schedule_arguments(store: MemoryJobStore) -> None:
    """Before: kombu.loads(accept=None) refused pickle (ContentDisallowed), so
    ``sched schedules``, ``schedules.list()`` and ``Job.args`` crashed."""
    client = Client(pickle_app(["pickle", "json"]), store=store, staging=False)
    args = ({1, 2}, dt.date(2020, 1, 2))
    job = client.schedule("tests.rich", args, {"when": dt.time(3, 4)}, key="k")
    assert job.content_type == PICKLE
    assert client.decode(job) == (args, {"when": dt.time(3, 4)})
    stored = client.get("k")
    assert stored is not None and client.decode(stored)[0] == args
    client.schedules.add("s", "tests.rich", 60, args=({3},), kwargs={"d": dt.date(2021, 1, 1)})
    (info,) = client.schedules.list()
    assert (info.args, info.kwargs) == (({3},), {"d": dt.date(2021, 1, 1)})
    assert client.schedules.get("s").args == ({3},)  # type: ignore[union-attr]
    assert client.schedules.update("s", kwargs={}).args == ({3},)


def test_content_the_app_does_not_accept_is_refused_and_never_unpickled(
    store: MemoryJobStore, insecure_serializers_enabled: None
) -> None:
    """Before: with pickle enabled in the process, loads(accept=None) unpickled
    whatever a row held, whatever the app accepts."""
    writer = Client(pickle_app(["pickle", "json"]), store=store, staging=False)
    job = writer.schedule("tests.rich", (Boom(),), key="k")
    writer.schedules.add("s", "tests.rich", 60, args=(Boom(),))
    UNPICKLED.clear()
    reader = Client(pickle_app(["json"]), store=store, staging=False)
    with pytest.raises(UntrustedContent, match=f"'{PICKLE}'.*accept_content") as info:
        reader.decode(job)
    assert "job 'k'" in str(info.value)
    # Listings go on: the schedule shows as broken, its arguments unread.
    [listed] = reader.schedules.list()
    assert listed.undecodable is not None
    assert f"schedule 's' is stored as '{PICKLE}'" in listed.undecodable
    assert listed.state == "broken" and listed.args == ()
    got = reader.schedules.get("s")
    assert got is not None and got.undecodable == listed.undecodable
    # A Job has no app: JSON only, unless told otherwise.
    with pytest.raises(UntrustedContent, match=PICKLE):
        _ = job.args
    with pytest.raises(UntrustedContent, match=PICKLE):
        job.decode(["json"])
    assert UNPICKLED == []
    assert job.decode(["pickle"]) == ((None,), {})  # the app that accepts it may
    assert UNPICKLED == ["unpickled"]


def test_json_jobs_decode_by_default(client: Client) -> None:
    job = client.schedule("tests.add", [1], {"y": 2})
    assert (job.args, job.kwargs) == ((1,), {"y": 2})
    assert client.decode(job) == ((1,), {"y": 2})


def test_a_corrupt_body_is_a_clear_error(client: Client) -> None:
    job = client.schedule("tests.add", [1], key="k")
    broken = Job(**{**{f: getattr(job, f) for f in job.__slots__}, "body": b"[1, 2"})
    with pytest.raises(UndecodableBody, match="job 'k' cannot be decoded"):
        client.decode(broken)


# -- values that cannot be stored (issue 13, defects 6, 10, 11 and item 13) ----------


def test_a_due_time_past_year_6053_is_refused_on_both_paths(
    client: Client, store: MemoryJobStore
) -> None:
    """Before: schedule() failed in the store (StoreError) and schedule_many()
    stored a due_bucket that had wrapped past the int32 range."""
    with pytest.raises(InvalidTime, match=r"too late.*6053"):
        client.schedule("tests.add", [1], eta=dt.datetime(7000, 1, 1, tzinfo=UTC))
    rows = [{"task": "tests.add", "eta": T0}, {"task": "tests.add", "eta": DUE_LIMIT}]
    with pytest.raises(InvalidTime, match=r"row 1: .*too late"):
        client.schedule_many(rows)
    assert nothing_written(store)


@pytest.mark.parametrize("key", ["nightly@2026-12-04T00:00:00Z", "n@2026-12-04T00:00:00.250000Z"])
def test_a_caller_key_shaped_like_an_occurrence_key_is_refused(
    client: Client, store: MemoryJobStore, key: str
) -> None:
    """Before: accepted; the planner then found the key taken and skipped the occurrence."""
    with pytest.raises(InvalidJob, match="reserved for the occurrences of periodic schedules"):
        client.schedule("tests.add", [1], key=key)
    with pytest.raises(InvalidJob, match=r"row 1: .*reserved for the occurrences"):
        client.schedule_many([{"task": "tests.add"}, {"task": "tests.add", "key": key}])
    assert nothing_written(store)


def test_occurrences_still_get_their_keys(client: Client) -> None:
    client.schedules.add("nightly", "tests.add", 60, args=[1])
    job = client.schedules.trigger("nightly")
    assert job is not None and job.key.startswith("nightly@") and job.key.endswith("Z")


@pytest.mark.parametrize(
    "name", ["eta", "retries", "shadow", "celery_sched_epoch", "celery_sched_failures"]
)
def test_reserved_headers_are_refused_everywhere_a_job_is_defined(
    client: Client, store: MemoryJobStore, name: str
) -> None:
    """Before: accepted, and the header overrode the protocol field at publish."""
    headers = {"tenant": "a", name: 1}
    with pytest.raises(InvalidJob, match=f"must not set '{name}'"):
        client.schedule("tests.add", [1], headers=headers)
    with pytest.raises(InvalidJob, match=f"row 0: .*must not set '{name}'"):
        client.schedule_many([{"task": "tests.add", "headers": headers}])
    with pytest.raises(InvalidSchedule, match=f"must not set '{name}'"):
        client.schedules.add("s", "tests.add", 60, headers=headers)
    assert nothing_written(store) and client.schedules.list() == []


@pytest.mark.parametrize(
    ("schedule", "extra", "match"),
    [
        (1e300, {}, "interval must be a finite number of seconds, at most"),
        (MAX_SECONDS * 2, {}, "interval"),
        (dt.timedelta(days=999_999_999), {}, "interval"),
        (60, {"catchup_window": math.inf}, "catchup_window"),
        (60, {"catchup_window": 1e300}, "catchup_window"),
        (60, {"max_catchup": 2**31}, "max_catchup"),
        (60, {"max_attempts": 2**31}, "max_attempts"),
        (60, {"expires": 2e11}, "expires"),
        (60, {"visibility_timeout": 1e300}, "visibility_timeout"),
        (clocked("7000-01-01T00:00:00Z"), {}, "clocked time .* not before 6053"),
    ],
)
def test_schedules_that_cannot_be_stored_or_planned_are_refused(
    client: Client, schedule: Any, extra: dict[str, Any], match: str
) -> None:
    """Before: 1e300 raised a bare OverflowError; the others were stored and
    then failed the planner (an expires that overflows past year 6053, a
    clocked occurrence whose due_bucket overflows) or the store."""
    with pytest.raises(InvalidSchedule, match=match):
        client.schedules.add("s", "tests.add", schedule, **extra)
    assert client.schedules.list() == []


def test_a_cluster_that_does_not_answer_only_costs_the_staging(
    app: Celery, store: MemoryJobStore, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.e2e.harness import free_port

    # redis-py's Cluster client used to raise its own error when built, after
    # the insert had committed; now staging fails as any Redis outage does.
    url = f"redis+cluster://127.0.0.1:{free_port()}/"
    client = Client(app, settings=Settings(redis_url=url), store=store)
    due = dt.datetime.now(UTC) + dt.timedelta(seconds=5)
    with caplog.at_level("WARNING", logger="celery_sched.client"):
        assert (
            client.schedule_many([{"task": "tests.add", "args": [1], "eta": due, "key": "k"}]) == 1
        )
    assert store.get("k") is not None
    assert "could not stage 1 new jobs" in caplog.text
    assert "Redis Cluster cannot be connected" in caplog.text
