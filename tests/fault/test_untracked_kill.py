"""Workers left as they are (no tracking): a beat killed between claim and
publish loses no job.

Nothing reports an untracked job's run, so the reconciler ends a dispatched
one ``sent`` instead of sending it twice. Before #30 it did so for every
stale dispatched job, including the batches a killed beat had claimed but
never published: those never reached the broker and never ran.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from typing import Any

import pytest
import redis

from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import wait_for

pytestmark = pytest.mark.slow

JOBS = 20_000


def _queued_ids(client: redis.Redis, queue: str) -> set[str]:
    """The task ids of every message waiting in ``queue`` (all priority lists)."""
    ids: set[str] = set()
    for name in client.scan_iter(match=f"{queue}*"):
        if client.type(name) != b"list":
            continue
        for raw in client.lrange(name, 0, -1):
            ids.add(json.loads(raw)["headers"]["id"])
    return ids


def test_kill_9_mid_sweep_with_untracked_workers_sends_every_job(
    redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    settings = dataclasses.replace(e2e_settings, visibility_timeout=3.0, batch_size=1000)
    cluster = make_cluster(redis_url, settings)
    beat1 = cluster.start_beat("beat1")
    wait_for(cluster.leader, timeout=30, what="a leader")
    client = client_for(settings)
    # Due already: the sweep claims them straight from PostgreSQL, three
    # batches ahead of the one being published.
    jobs = spread_jobs(JOBS, time.time() - 60, 1, tag="untracked")
    client.schedule_many(jobs)

    def dispatched() -> int:
        return int(cluster.query("SELECT count(*) FROM {s}.jobs WHERE status <> 'pending'")[0][0])

    wait_for(lambda: dispatched() >= 3000, timeout=60, interval=0.002, what="the sweep to start")
    beat1.signal(signal.SIGKILL)
    claimed_when_killed = dispatched()
    print(f"killed the leader with {claimed_when_killed} of {JOBS} jobs claimed")

    # No worker ever ran, so no heartbeat lists the task: untracked.
    cluster.start_beat("beat2")
    broker = redis.Redis.from_url(redis_url)

    def settled() -> bool:
        rows = cluster.query(
            "SELECT count(*) FROM {s}.jobs WHERE status IN ('pending', 'dispatched')"
        )
        return int(rows[0][0]) == 0

    wait_for(settled, timeout=90, what="every job to leave pending and dispatched")
    statuses = dict(cluster.query("SELECT status, count(*) FROM {s}.jobs GROUP BY status"))
    assert statuses == {"sent": JOBS}
    queued = _queued_ids(broker, cluster.queue)
    ids = {str(row[0]) for row in cluster.query("SELECT id FROM {s}.jobs")}
    missing = ids - queued
    assert not missing, (
        f"{len(missing)} jobs ended sent but no message of theirs reached the broker"
    )
