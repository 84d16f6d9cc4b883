"""Moving rows between shards on the real database, while they are claimed
(issue 17): a row is never claimed twice and never lost, whichever of the
claim and the move takes its lock first."""

from __future__ import annotations

import datetime as dt
import threading
import zlib
from collections.abc import Callable
from typing import Any

from sqlalchemy.engine import Connection

from celery_sched.models import SENT_DUE_MARGIN, JobStatus
from celery_sched.store.postgres import PostgresJobStore
from celery_sched.store.postgres.connection import RawStatement, raw_cursor
from tests.contract.conftest import new_job
from tests.e2e.harness import wait_for

SECOND = dt.timedelta(seconds=1)


def a_key_of(shards: int, shard: int) -> str:
    """A key that hashes to ``shard`` of ``shards``."""
    return next(
        key
        for key in (f"key-{i}" for i in range(10_000))
        if zlib.crc32(key.encode()) % shards == shard
    )


def blocked_on_a_lock(store: PostgresJobStore) -> bool:
    """Whether another backend of this database waits for a row lock."""
    with store.engine.connect() as conn:
        waiting = conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).scalar_one()
    return bool(waiting)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def claimed(conn: Connection, stmt: Any, **params: Any) -> list[Any]:
    """Ids a claim statement claims inside ``conn``'s transaction, run as
    the store runs it (precompiled, on the raw cursor)."""
    raw = RawStatement(stmt)
    # The partition bound a claim gets from its epoch fence: a day ahead.
    horizon = dt.datetime.now(dt.UTC) + SENT_DUE_MARGIN
    with raw_cursor(conn) as cur:
        cur.execute(raw.sql, raw.params(p_epoch=1, p_horizon=horizon, **params))
        return [row[0] for row in cur.fetchall()]


def claim_ids_in(conn: Connection, store: PostgresJobStore, ids: list[Any], shard: int) -> int:
    return len(claimed(conn, store.statements.claim_ids, ids=ids, p_shard=shard))


def test_a_claim_holding_the_row_delays_the_move_which_then_moves_it_dispatched(
    store: PostgresJobStore,
) -> None:
    """The old shard's leader claims first; the move waits for its lock,
    re-checks the row (still unfinished, still in shard 3) and moves it as
    dispatched: claimed once, owned by the new shard's reconciler."""
    key = a_key_of(4, 3)
    job = store.add_job(new_job(key, store.now() - SECOND, shard=3))
    shard_of = lambda k: zlib.crc32(k.encode()) % 2  # noqa: E731
    with store.engine.connect() as claim:
        tx = claim.begin()
        assert claim_ids_in(claim, store, [job.id], shard=3) == 1
        mover, result = in_thread(
            lambda: store.rehome(shards=2, shard_of=shard_of, limit=10, stranded_only=True)
        )
        wait_for(lambda: blocked_on_a_lock(store), timeout=10, what="the move to wait")
        assert mover.is_alive()
        tx.commit()
    mover.join(10)
    [moved] = result[0].moved
    assert (moved.from_shard, moved.to_shard) == (3, shard_of(key))
    stored = store.get_by_id(job.id)
    assert stored is not None
    assert (stored.status, stored.shard) == (JobStatus.DISPATCHED, shard_of(key))
    # The new shard's leader finds nothing to claim: it was claimed once.
    with store.engine.begin() as conn:
        assert claim_ids_in(conn, store, [job.id], shard=shard_of(key)) == 0


def test_a_move_holding_the_row_makes_the_old_shards_claim_skip_it(
    store: PostgresJobStore,
) -> None:
    """The move locks first: the old shard's claim of the staged id skips
    the locked row, and once the move commits its shard test fails; the new
    shard's leader claims it, once."""
    key = a_key_of(4, 3)
    job = store.add_job(new_job(key, store.now() - SECOND, shard=3))
    target = zlib.crc32(key.encode()) % 2
    params = {"r_ids": [job.id], "r_from": [3], "r_to": [target]}
    with store.engine.connect() as move:
        tx = move.begin()
        assert move.execute(store.statements.rehome, params).rowcount == 1
        with store.engine.begin() as claim:
            assert claim_ids_in(claim, store, [job.id], shard=3) == 0  # skipped: locked
        tx.commit()
    with store.engine.begin() as claim:
        assert claim_ids_in(claim, store, [job.id], shard=3) == 0  # no longer in shard 3
    with store.engine.begin() as claim:
        assert claim_ids_in(claim, store, [job.id], shard=target) == 1
    with store.engine.begin() as claim:
        assert claim_ids_in(claim, store, [job.id], shard=target) == 0


def test_a_claim_by_due_time_during_the_move_skips_the_row_and_never_sees_it_again(
    store: PostgresJobStore,
) -> None:
    """The old shard's claim by due time while the move holds the row skips
    it (SKIP LOCKED); after the move it is no longer in that shard's scan,
    and the new shard's claim by due time takes it."""
    key = a_key_of(4, 3)
    job = store.add_job(new_job(key, store.now() - SECOND, shard=3))
    target = zlib.crc32(key.encode()) % 2
    due = store.statements.claim_due
    with store.engine.connect() as move:
        tx = move.begin()
        move.execute(store.statements.rehome, {"r_ids": [job.id], "r_from": [3], "r_to": [target]})
        with store.engine.begin() as claim:
            assert claimed(claim, due, p_shard=3, p_limit=10) == []
        tx.commit()
    with store.engine.begin() as claim:
        assert claimed(claim, due, p_shard=3, p_limit=10) == []
        assert claimed(claim, due, p_shard=target, p_limit=10) == [job.id]


def test_a_row_finished_while_the_move_waits_stays_finished_where_it_was(
    store: PostgresJobStore,
) -> None:
    """A worker's report holds the row; the move re-checks the status on
    the row's latest version and leaves a finished job alone."""
    key = a_key_of(4, 3)
    job = store.add_job(new_job(key, store.now() - SECOND, shard=3))
    shard_of = lambda k: zlib.crc32(k.encode()) % 2  # noqa: E731
    with store.engine.connect() as report:
        tx = report.begin()
        report.exec_driver_sql(
            f'UPDATE "{store.settings.db_schema}".jobs SET status = %(s)s, finished_at = now() '
            "WHERE id = %(id)s",
            {"s": "succeeded", "id": job.id},
        )
        mover, result = in_thread(
            lambda: store.rehome(shards=2, shard_of=shard_of, limit=10, stranded_only=True)
        )
        wait_for(lambda: blocked_on_a_lock(store), timeout=10, what="the move to wait")
        tx.commit()
    mover.join(10)
    assert result[0].moved == ()
    stored = store.get_by_id(job.id)
    assert stored is not None and (stored.status, stored.shard) == (JobStatus.SUCCEEDED, 3)
