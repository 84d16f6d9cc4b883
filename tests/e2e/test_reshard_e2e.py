"""Changing ``celery_sched_shards`` while jobs flow (issue 17): the beats are
stopped and started again with the new count, one per shard, with real
Celery workers running throughout. Every job runs, once; none is left
unfinished or stranded."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import pytest

from celery_sched.settings import Settings
from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import Cluster, Proc, wait_for

pytestmark = pytest.mark.slow

UNFINISHED = "('pending', 'dispatched', 'running', 'retrying')"


def start_beats(cluster: Cluster, shards: int, name: str) -> list[Proc]:
    """One beat per shard, as a fleet runs them."""
    return [
        cluster.start_beat(
            f"{name}-{shard}", CELERY_SCHED_SHARDS=str(shards), CELERY_SCHED_SHARD=str(shard)
        )
        for shard in range(shards)
    ]


def leaders(cluster: Cluster, shards: int, after: float) -> bool:
    """Whether every shard has a leader elected after ``after`` (epoch time)."""
    rows = cluster.query(
        "SELECT count(*) FROM {s}.leaders WHERE shard < %s AND acquired_at > to_timestamp(%s)",
        shards,
        after,
    )
    return int(rows[0][0]) == shards


def placed_for(cluster: Cluster) -> int | None:
    rows = cluster.query("SELECT shards FROM {s}.placement")
    return int(rows[0][0]) if rows else None


def assert_every_job_ran_once(cluster: Cluster, keys: set[str]) -> None:
    runs = cluster.runs()
    per_key = collections.Counter(key for _id, key, _due, _ran in runs)
    duplicates = {k: n for k, n in per_key.items() if n > 1}
    assert not duplicates, f"jobs executed more than once: {list(duplicates.items())[:10]}"
    assert set(per_key) == keys, sorted(keys - set(per_key))[:10]
    per_id = collections.Counter(task_id for task_id, _key, _due, _ran in runs)
    assert max(per_id.values()) == 1
    statuses = dict(cluster.query("SELECT status, count(*) FROM {s}.jobs GROUP BY status"))
    assert statuses == {"succeeded": len(keys)}, statuses
    assert cluster.query(f"SELECT count(*) FROM {{s}}.jobs WHERE status IN {UNFINISHED}") == [(0,)]


def not_run(cluster: Cluster) -> str:
    """The jobs without a recorded run, counted by (status, shard, attempt),
    with a few of them in full: what a failure needs to be understood."""
    missing = (
        "FROM {s}.jobs j WHERE NOT EXISTS (SELECT 1 FROM {s}.e2e_runs r WHERE r.job_key = j.key)"
    )
    counts = cluster.query(
        f"SELECT status, shard, attempt, leader_epoch, count(*) {missing} GROUP BY 1, 2, 3, 4"
    )
    sample = cluster.query(
        f"SELECT key, status, shard, attempt, leader_epoch, due_at, dispatched_at {missing}"
        " ORDER BY due_at LIMIT 5"
    )
    return f"{counts}; {sample}"


def change_count_while_jobs_flow(
    cluster: Cluster, settings: Settings, *, before: int, after: int
) -> set[str]:
    """Jobs due over the next seconds under ``before`` shards; the beats
    restarted with ``after`` while they are due; more jobs under ``after``.
    Returns every key scheduled."""
    cluster.start_worker(concurrency=8)
    old_beats = start_beats(cluster, before, f"beat{before}")
    started = time.time()
    wait_for(lambda: leaders(cluster, before, started - 1), timeout=40, what="old leaders")
    old = client_for(dataclasses.replace(settings, shards=before))
    first = spread_jobs(400, time.time() + 1, 12, tag="old")
    assert old.schedule_many(first) == 400
    wait_for(lambda: cluster.run_count() >= 40, timeout=30, what="the first runs")
    for beat in old_beats:
        beat.stop()
    assert cluster.run_count() < 400, "the change must happen while jobs are due"
    restarted = time.time()
    start_beats(cluster, after, f"beat{after}")
    new = client_for(dataclasses.replace(settings, shards=after))
    second = spread_jobs(200, time.time() + 1, 6, tag="new")
    assert new.schedule_many(second) == 200
    wait_for(lambda: leaders(cluster, after, restarted), timeout=40, what="new leaders")
    keys = {job["key"] for job in first + second}
    try:
        wait_for(lambda: cluster.run_count() >= len(keys), timeout=60, what="every job to run")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; the jobs that did not run: {not_run(cluster)}") from None
    wait_for(lambda: placed_for(cluster) == after, timeout=20, what="the placement recorded")
    time.sleep(1)  # a duplicate would show up now
    return keys


def test_raising_the_shard_count_while_jobs_flow_runs_every_job_once(
    redis_url: str, make_cluster: Any, e2e_settings: Settings
) -> None:
    settings = dataclasses.replace(e2e_settings, shards=1)
    cluster = make_cluster(redis_url, settings)
    keys = change_count_while_jobs_flow(cluster, settings, before=1, after=4)
    assert_every_job_ran_once(cluster, keys)
    # The old rows still pending at the change moved to their key's shard
    # and were dispatched by its leader (the new leaders' epochs).
    moved = cluster.query("SELECT count(*) FROM {s}.jobs WHERE key LIKE 'old-%%' AND shard > 0")
    assert int(moved[0][0]) > 0
    shard0 = next(p for p in cluster.procs if p.name == "beat4-0")
    assert "placed for another shard count" in shard0.output()


def test_lowering_the_shard_count_while_jobs_flow_runs_every_job_once(
    redis_url: str, make_cluster: Any, e2e_settings: Settings
) -> None:
    settings = dataclasses.replace(e2e_settings, shards=4)
    cluster = make_cluster(redis_url, settings)
    keys = change_count_while_jobs_flow(cluster, settings, before=4, after=2)
    assert_every_job_ran_once(cluster, keys)
    shard0 = next(p for p in cluster.procs if p.name == "beat2-0")
    assert "stranded in shards >= 2" in shard0.output()
