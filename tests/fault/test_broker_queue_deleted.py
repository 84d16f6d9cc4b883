"""The broker's queue key is deleted while messages wait in it: every job still runs, once.

A Redis broker keeps a Celery queue as one list (the queue's name is the
key); ``DEL`` drops every message in it, and nothing tells the scheduler.
Those jobs stay ``dispatched`` until the reconciler's visibility timeout
(15 s here: longer than the messages wait before the ``DEL``) requeues
them; ``celery_sched.Task`` makes sure that a job whose message was taken
just before the ``DEL`` does not run a second time.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
import redis

from celery_sched.client import Client
from celery_sched.settings import Settings
from tests.e2e import task_app
from tests.e2e.harness import wait_for

pytestmark = pytest.mark.slow

JOBS = 300


def test_deleted_broker_queue_key_is_requeued_and_every_job_runs_once(
    redis_url: str, make_effect_cluster: Any, e2e_settings: Settings
) -> None:
    settings = dataclasses.replace(e2e_settings, visibility_timeout=15.0)
    cluster = make_effect_cluster(redis_url, settings)
    cluster.start_beat("beat1")
    wait_for(cluster.leader, timeout=30, what="a leader")
    keys = [f"dropped-{n:04d}" for n in range(JOBS)]
    with Client(task_app.app, settings=settings) as client:
        client.schedule_many(
            # A twentieth of a second of work each: the worker is still busy
            # with the first ones when the queue goes.
            {"task": "tasks.effect", "args": [key, 0.05], "key": key, "queue": cluster.queue}
            for key in keys
        )
    broker = redis.Redis.from_url(redis_url)
    wait_for(
        lambda: broker.llen(cluster.queue) >= JOBS,
        timeout=30,
        what="every message to wait in the broker's queue",
    )
    cluster.start_worker("worker1", concurrency=4)
    wait_for(
        lambda: sum(cluster.effects().values()) >= 10,
        timeout=30,
        what="the worker to take the first messages",
    )

    deleted_at = time.monotonic()
    assert broker.delete(cluster.queue) == 1
    ran_before = set(cluster.effects())
    assert len(ran_before) < JOBS, "messages must have been waiting when the key went"
    assert _requeued(cluster, keys) == 0, "the reconciler must not have acted before the DEL"

    counts = cluster.wait_effects(keys, timeout=60)
    recovered = time.monotonic() - deleted_at
    print(f"{JOBS - len(ran_before)} messages dropped, all run {recovered:.1f}s after the DEL")
    assert {key: n for key, n in counts.items() if n > 1} == {}
    # They came back through the reconciler.
    assert _requeued(cluster, keys) >= JOBS - len(ran_before) - 20


def _requeued(cluster: Any, keys: list[str]) -> int:
    rows = cluster.query("SELECT count(*) FROM {s}.jobs WHERE key = ANY(%s) AND attempt > 0", keys)
    return int(rows[0][0])
