"""The Client API on the in-memory store: writes, refusals that write nothing,
all-or-nothing bulk scheduling."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_sched.client import Client
from celery_sched.errors import (
    DuplicateJob,
    InvalidArguments,
    InvalidJob,
    InvalidTime,
    PayloadTooLarge,
    StagingUnavailable,
    UnknownOption,
    UnknownTask,
)
from celery_sched.models import JobStatus
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
