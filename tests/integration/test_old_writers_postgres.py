"""Clients from before migration 0012 still running after ``sched migrate``.

Before 0012, ``jobs`` had a unique index on ``key`` and every writer relied
on it; since 0012 a key is unique only through its ``job_keys`` entry, which
old writers know nothing of. The statements below are the old writers' own
shapes (a plain INSERT that expected a unique violation, INSERT ... ON
CONFLICT DO NOTHING without a target, COPY), frozen here as the old code
sent them; each must now fail loudly instead of storing a key twice."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from celery_sched.errors import DuplicateJob
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore
from tests.contract.conftest import new_job

pytestmark = pytest.mark.integration

_COLUMNS = "id, key, task, body, content_type, content_encoding, due_at, due_bucket, shard"


def _values(key: str, due_at: dt.datetime) -> tuple[Any, ...]:
    bucket = int(due_at.timestamp() // 60)
    return (uuid.uuid4(), key, "tests.add", b"[[], {}, {}]", "application/json", "utf-8",
            due_at, bucket, 0)  # fmt: skip


def _old_insert(conn: psycopg.Connection[Any], schema: str, key: str, due: dt.datetime) -> None:
    # Old add_job(if_exists="raise"): a taken key was a unique violation.
    conn.execute(
        f'INSERT INTO "{schema}".jobs ({_COLUMNS}) VALUES ({", ".join(["%s"] * 9)}) RETURNING id',
        _values(key, due),
    )


def _old_insert_or_nothing(
    conn: psycopg.Connection[Any], schema: str, key: str, due: dt.datetime
) -> None:
    # Old add_job(if_exists="return"): no conflict target, the key index decided.
    conn.execute(
        f'INSERT INTO "{schema}".jobs ({_COLUMNS}) VALUES ({", ".join(["%s"] * 9)}) '
        "ON CONFLICT DO NOTHING RETURNING id",
        _values(key, due),
    )


def _old_copy(conn: psycopg.Connection[Any], schema: str, key: str, due: dt.datetime) -> None:
    # Old load_jobs: COPY straight into jobs, the unique index refusing a taken key.
    with conn.cursor().copy(f'COPY "{schema}".jobs ({_COLUMNS}) FROM STDIN') as copy:
        copy.write_row(_values(key, due))


OldWrite = Callable[[psycopg.Connection[Any], str, str, dt.datetime], None]
OLD_WRITES: dict[str, OldWrite] = {
    "insert": _old_insert,
    "insert-or-nothing": _old_insert_or_nothing,
    "copy": _old_copy,
}


@pytest.fixture
def store(settings: Settings) -> Iterator[PostgresJobStore]:
    backend = PostgresJobStore(settings)
    backend.migrate()
    # The leader keeps a week of partitions made ahead; old writers relied on it.
    backend.prepare_storage()
    yield backend
    backend.close()


def _rows_with_key(settings: Settings, key: str) -> int:
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        row = conn.execute(
            f'SELECT count(*) FROM "{settings.db_schema}".jobs WHERE key = %s', (key,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def _try_old_write(settings: Settings, write: OldWrite, key: str, due: dt.datetime) -> None:
    """The old writer's statement in its own transaction; it must be refused."""
    with (
        psycopg.connect(settings.libpq_conninfo()) as conn,
        pytest.raises(psycopg.errors.IntegrityError, match="job_keys"),
    ):
        write(conn, settings.db_schema, key, due)
        conn.commit()


@pytest.mark.parametrize("shape", sorted(OLD_WRITES))
def test_an_old_writer_cannot_store_a_key_a_new_client_holds(
    store: PostgresJobStore, settings: Settings, shape: str
) -> None:
    due = store.now() + dt.timedelta(hours=1)
    store.add_job(new_job("order:1", due))
    # A day later: another partition, so no index of jobs could see the clash.
    _try_old_write(settings, OLD_WRITES[shape], "order:1", due + dt.timedelta(days=1))
    assert _rows_with_key(settings, "order:1") == 1


@pytest.mark.parametrize("shape", sorted(OLD_WRITES))
def test_a_key_an_old_writer_tried_stays_free_for_a_new_client(
    store: PostgresJobStore, settings: Settings, shape: str
) -> None:
    due = store.now() + dt.timedelta(hours=1)
    _try_old_write(settings, OLD_WRITES[shape], "order:2", due)
    store.add_job(new_job("order:2", due + dt.timedelta(days=1)))
    with pytest.raises(DuplicateJob):
        store.add_job(new_job("order:2", due))
    assert _rows_with_key(settings, "order:2") == 1


@pytest.mark.parametrize("pgbouncer", [False, True])
def test_every_new_write_path_still_stores_keyed_rows(
    store: PostgresJobStore, settings: Settings, pgbouncer: bool
) -> None:
    # Behind PgBouncer the revision is said per transaction, not at start-up.
    store = PostgresJobStore(dataclasses.replace(settings, pgbouncer=pgbouncer))
    due = store.now() + dt.timedelta(hours=1)
    store.add_job(new_job("single", due))
    store.add_job(new_job("single", due), if_exists="return")
    chosen = uuid.uuid4()  # a caller's v4 UUID key: its entry is the id
    store.add_job(new_job(str(chosen), due, id=chosen))
    assert store.load_jobs([new_job(f"bulk:{n}", due + dt.timedelta(days=n)) for n in range(3)])
    occurrences = [new_job("nightly@2031-01-01T00:00:00Z", due, schedule_id=None)]
    assert len(store.add_occurrences(occurrences)) == 1
    for key in ("single", "bulk:0", "bulk:2", "nightly@2031-01-01T00:00:00Z"):
        assert _rows_with_key(settings, key) == 1
    store.close()
