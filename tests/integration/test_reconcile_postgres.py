"""The reconciler's scan of dispatched jobs against a real PostgreSQL (issue #31).

A pass must cost the stale rows it moves, not every job in flight: untracked
jobs stay ``dispatched`` a whole visibility timeout, 300,000 of them at
10,000 jobs/s and 30 s, and the pass runs on the leader's loop.
"""

from __future__ import annotations

import datetime as dt
import re

import psycopg
import pytest

from celery_sched.models import JobStatus
from celery_sched.settings import Settings
from celery_sched.store.postgres import PostgresJobStore
from tests.contract.conftest import new_job, tracked

pytestmark = pytest.mark.integration

#: Dispatched jobs in flight, not stale, in the plan test.
IN_FLIGHT = 20_000


def dispatch(settings: Settings, keys: dict[str, tuple[float | None, float, int]]) -> None:
    """Make each job of ``keys`` dispatched ``ago`` seconds ago with its own
    visibility ``timeout`` (None: the default) in ``shard``."""
    schema = settings.db_schema
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        for key, (timeout, ago, shard) in keys.items():
            conn.execute(
                f"UPDATE \"{schema}\".jobs SET status = 'dispatched', shard = %s, "
                "visibility_timeout = %s, dispatched_at = now() - %s * interval '1 second' "
                "WHERE key = %s",
                (shard, timeout, ago, key),
            )


#: key: (own visibility timeout, seconds since dispatch, shard), with a
#: default timeout of 300 s. Stale: those dispatched longer ago than their
#: timeout, in shard 0.
CASES: dict[str, tuple[float | None, float, int]] = {
    "default-fresh": (None, 299, 0),
    "default-stale": (None, 301, 0),
    "short-fresh": (5, 4, 0),
    "short-stale": (5, 6, 0),
    "long-fresh": (3600, 3590, 0),
    "long-stale": (3600, 3610, 0),
    "other-shard": (5, 3610, 1),
}
STALE = {"default-stale", "short-stale", "long-stale"}


@pytest.mark.parametrize("tracking", [True, False])
def test_each_job_is_reconciled_exactly_when_its_own_timeout_ran_out(
    store: PostgresJobStore, settings: Settings, tracking: bool
) -> None:
    if tracking:
        tracked(store)
    now = store.now()
    store.load_jobs(new_job(key, earlier_today(now, hours=2)) for key in CASES)
    dispatch(settings, CASES)
    epoch = store.acquire_epoch(0, "test")
    result = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=300)
    moved = JobStatus.PENDING if tracking else JobStatus.SENT
    statuses = {key: store.get(key).status for key in CASES}  # type: ignore[union-attr]
    assert {key for key, status in statuses.items() if status is moved} == STALE, statuses
    assert {statuses[key] for key in CASES.keys() - STALE} == {JobStatus.DISPATCHED}
    assert (result.requeued, result.untracked) == ((3, 0) if tracking else (0, 3))


def test_the_limit_takes_those_stale_soonest_first(
    store: PostgresJobStore, settings: Settings
) -> None:
    tracked(store)
    now = store.now()
    store.load_jobs(new_job(key, earlier_today(now, hours=2)) for key in CASES)
    dispatch(settings, CASES)
    epoch = store.acquire_epoch(0, "test")
    # Stale since: long 10 s, default 1 s, short 1 s (dispatched 6 s ago, 5 s).
    order = []
    for _ in range(3):
        store.reconcile(shard=0, epoch=epoch, limit=1, default_visibility_timeout=300)
        order += [
            key
            for key in sorted(STALE)
            if key not in order and store.get(key).status is JobStatus.PENDING  # type: ignore[union-attr]
        ]
    assert order[0] == "long-stale" and set(order) == STALE


def earlier_today(now: dt.datetime, **before: float) -> dt.datetime:
    """``now`` less ``before``, but not before the start of now's UTC day: the
    jobs stay in the partition that holds now whatever the time of day, so
    no tiny partition of yesterday's makes a sequential scan the cheaper plan.
    (Only due times: staleness is by ``dispatched_at``.)"""
    day = now.astimezone(dt.UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(day, now - dt.timedelta(**before))


def _buffers(store: PostgresJobStore, statement: str) -> tuple[int, str]:
    """Shared buffers one run of ``statement`` touched (EXPLAIN ANALYZE,
    rolled back), and its plan."""
    compiled = getattr(store.statements, statement).compile(dialect=store.engine.dialect)
    params = {**compiled.params, "p_shard": 0, "p_limit": 10_000, "default_timeout": 300.0}
    with store.engine.connect() as conn:
        rows = conn.exec_driver_sql(
            f"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {compiled.string}", params
        ).all()
        conn.rollback()
    plan = "\n".join(row[0] for row in rows)
    # The first Buffers line is the whole statement's.
    found = re.search(r"Buffers: shared((?: \w+=\d+)+)", plan)
    assert found, plan
    return sum(int(n) for n in re.findall(r"=(\d+)", found.group(1))), plan


def test_a_pass_reads_the_stale_rows_not_every_job_in_flight(
    store: PostgresJobStore, settings: Settings
) -> None:
    # Before 0015 the test "dispatched_at < now() - coalesce(visibility_
    # timeout, default)" had no index range: both statements walked every
    # dispatched row of every shard (20,000 here: thousands of buffers).
    tracked(store, "tracked.task")
    now = store.now()
    store.load_jobs(
        new_job(
            f"f{i}", earlier_today(now, minutes=5), task=f"{'tracked' if i % 2 else 'other'}.task"
        )
        for i in range(IN_FLIGHT)
    )
    store.load_jobs(new_job(key, earlier_today(now, hours=2)) for key in CASES)
    schema = settings.db_schema
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        # In flight, none stale: half with a timeout of their own (of every
        # length from 60 s to an hour), in both shards; and as many stale
        # in shard 1, which shard 0's pass must not read.
        conn.execute(
            f"UPDATE \"{schema}\".jobs SET status = 'dispatched', "
            "dispatched_at = now() - (random() * 50) * interval '1 second', "
            "shard = CASE WHEN random() < 0.5 THEN 0 ELSE 1 END, "
            "visibility_timeout = CASE WHEN random() < 0.5 THEN 60 + random() * 3540 END "
            "WHERE key LIKE 'f%%'"
        )
        conn.execute(
            f"UPDATE \"{schema}\".jobs SET dispatched_at = now() - interval '2 hours' "
            "WHERE key LIKE 'f%%' AND shard = 1"
        )
    dispatch(settings, CASES)
    with psycopg.connect(settings.libpq_conninfo(), autocommit=True) as conn:
        conn.execute(f'VACUUM ANALYZE "{schema}".jobs')
    budgets, plans = {}, {}
    for statement in ("requeue_dispatched", "mark_untracked"):
        budgets[statement], plans[statement] = _buffers(store, statement)
    # A few index descents per partition and statement, and the stale rows:
    # not 20,000 rows (about 600 heap pages and 100 index pages).
    assert all(buffers < 250 for buffers in budgets.values()), budgets
    for plan in plans.values():
        assert "jobs_dispatched_idx" in plan, plan
        assert "Seq Scan on jobs_" not in plan, plan
    # And it moves exactly the stale ones.
    epoch = store.acquire_epoch(0, "test")
    result = store.reconcile(shard=0, epoch=epoch, limit=100, default_visibility_timeout=300)
    assert result.untracked == 3 and result.requeued == 0
    counts = store.counts_by_status()
    assert counts[JobStatus.SENT] == 3 and counts[JobStatus.DISPATCHED] == IN_FLIGHT + 4
