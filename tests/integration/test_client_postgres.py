"""The Client against a real PostgreSQL store (a fresh schema per test)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery

from celery_sched.client import Client
from celery_sched.errors import DuplicateJob, InvalidArguments, SchemaMissing, UnknownTask
from celery_sched.models import JobStatus
from celery_sched.settings import Settings

pytestmark = pytest.mark.integration

UTC = dt.UTC


@pytest.fixture
def app() -> Celery:
    app = Celery("client_pg_tests", set_as_current=False)
    app.conf.update(timezone="America/New_York")

    @app.task(name="tests.add", shared=False)
    def add(x: int, y: int = 0) -> int:
        return x + y

    return app


@pytest.fixture
def client(app: Celery, settings: Settings) -> Iterator[Client]:
    with Client(app, settings=settings) as client:
        client.migrate()
        yield client


def row_count(settings: Settings) -> int:
    with psycopg.connect(settings.libpq_conninfo()) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{settings.db_schema}".jobs').fetchone()
        assert row is not None
        return int(row[0])


def test_schedule_get_round_trip(client: Client) -> None:
    eta = dt.datetime(2030, 7, 4, 9, 30)  # naive: New York time, EDT
    job = client.schedule(
        "tests.add",
        (1, "two"),
        {"y": 3.5},
        eta=eta,
        key="july-4",
        priority=7,
        expires=3600,
        max_attempts=2,
    )
    stored = client.get("july-4")
    assert stored == job
    assert stored.status is JobStatus.PENDING
    assert stored.due_at == dt.datetime(2030, 7, 4, 13, 30, tzinfo=UTC)
    assert stored.expires_at == dt.datetime(2030, 7, 4, 14, 30, tzinfo=UTC)
    assert stored.due_bucket == int(stored.due_at.timestamp()) // 60
    assert (stored.args, stored.kwargs) == ((1, "two"), {"y": 3.5})
    assert stored.argsrepr == "(1, 'two')"
    assert dict(stored.options) == {"priority": 7}
    assert stored.max_attempts == 2


def test_due_now_and_countdown_follow_postgres_clock(client: Client) -> None:
    before = client.store.now()
    now_job = client.schedule("tests.add", (1,))
    later = client.schedule("tests.add", (1,), countdown=120)
    after = client.store.now()
    assert before <= now_job.due_at <= after
    assert before + dt.timedelta(seconds=120) <= later.due_at <= after + dt.timedelta(seconds=120)


def test_duplicate_key(client: Client, settings: Settings) -> None:
    first = client.schedule("tests.add", (1,), key="once")
    with pytest.raises(DuplicateJob, match="'once'"):
        client.schedule("tests.add", (2,), key="once")
    assert client.schedule("tests.add", (2,), key="once", if_exists="return") == first
    assert row_count(settings) == 1


def test_the_key_a_keyless_job_was_given_is_taken(client: Client, settings: Settings) -> None:
    """A keyless job's key is its id's text; scheduling with that key again,
    one at a time or in bulk, is a duplicate of it."""
    first = client.schedule("tests.add", (1,))
    assert first.key == str(first.id)
    with pytest.raises(DuplicateJob, match=first.key):
        client.schedule("tests.add", (2,), key=first.key)
    assert client.schedule("tests.add", (2,), key=first.key, if_exists="return") == first
    with pytest.raises(DuplicateJob):
        client.schedule_many([{"task": "tests.add", "args": (3,), "key": first.key}])
    bulk = client.schedule_many([{"task": "tests.add", "args": (4,)}])
    assert bulk == 1
    assert client.get(first.key) == first
    assert client.cancel(first.key) is True


def test_invalid_input_writes_nothing(client: Client, settings: Settings) -> None:
    with pytest.raises(UnknownTask):
        client.schedule("tests.missing")
    with pytest.raises(InvalidArguments):
        client.schedule("tests.add", (object(),))
    assert row_count(settings) == 0


def test_cancel(client: Client) -> None:
    client.schedule("tests.add", (1,), key="c", countdown=600)
    assert client.cancel("c") is True
    job = client.get("c")
    assert job is not None
    assert job.status is JobStatus.CANCELLED
    assert job.finished_at is not None
    assert client.cancel("c") is False
    assert client.cancel("never") is False


def rows(n: int, start: int = 0, **extra: Any) -> Iterator[dict[str, Any]]:
    base = dt.datetime(2031, 1, 1, tzinfo=UTC)
    for i in range(start, start + n):
        yield {
            "task": "tests.add",
            "args": [i],
            "key": f"bulk-{i}",
            "eta": base + dt.timedelta(minutes=i),
            **extra,
        }


def test_schedule_many_streams_every_row(client: Client, settings: Settings) -> None:
    assert client.schedule_many(rows(2500, queue="bulk")) == 2500
    assert row_count(settings) == 2500
    job = client.get("bulk-1234")
    assert job is not None
    assert job.args == (1234,)
    assert job.due_at == dt.datetime(2031, 1, 1, tzinfo=UTC) + dt.timedelta(minutes=1234)
    assert dict(job.options) == {"queue": "bulk"}
    hours = client.counts_by_hour(JobStatus.PENDING)
    assert sum(hours.values()) == 2500
    assert hours[dt.datetime(2031, 1, 1, 0, tzinfo=UTC)] == 60
    assert client.counts_by_status() == {JobStatus.PENDING: 2500}


def test_schedule_many_bad_row_writes_nothing(client: Client, settings: Settings) -> None:
    batch: list[dict[str, Any]] = list(rows(1000))
    batch[700] = {"task": "tests.add", "args": "oops"}
    with pytest.raises(InvalidArguments, match=r"^row 700: "):
        client.schedule_many(batch)
    assert row_count(settings) == 0


def test_schedule_many_duplicate_writes_nothing(client: Client, settings: Settings) -> None:
    client.schedule("tests.add", key="bulk-999")
    with pytest.raises(DuplicateJob):
        client.schedule_many(rows(1500))
    assert row_count(settings) == 1
    with pytest.raises(DuplicateJob):
        client.schedule_many([*rows(10, start=5000), *rows(1, start=5003)])
    assert row_count(settings) == 1


def test_store_is_usable_after_a_failed_bulk_insert(client: Client, settings: Settings) -> None:
    with pytest.raises(DuplicateJob):
        client.schedule_many([*rows(3), *rows(1)])
    assert client.schedule_many(rows(3)) == 3
    assert row_count(settings) == 3


def test_missing_schema_is_reported(app: Celery, settings: Settings) -> None:
    with Client(app, settings=settings) as client, pytest.raises(SchemaMissing):
        client.schedule("tests.add", (1,))


def test_awkward_text_round_trips(client: Client) -> None:
    # NUL and lone surrogates survive in the JSON body; the reprs are escaped
    # so PostgreSQL text columns accept them, in single and bulk writes.
    job = client.schedule("tests.add", ("a\x00b", "\udc80", "ünï"), {"k": "\x00"}, key="odd")
    assert (
        client.schedule_many(
            [{"task": "tests.add", "args": ["x\x00"], "key": "odd-bulk", "kwargs": {"é": 1}}]
        )
        == 1
    )
    stored = client.get("odd")
    assert stored == job
    assert stored.args == ("a\x00b", "\udc80", "ünï")
    assert stored.kwargs == {"k": "\x00"}
    bulk = client.get("odd-bulk")
    assert bulk is not None
    assert bulk.args == ("x\x00",)
    assert bulk.argsrepr == "['x\\x00']"
    assert bulk.kwargsrepr == "{'é': 1}"
