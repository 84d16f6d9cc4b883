"""The plain-task delivery fence in real worker processes (celery_sched.fence).

The fence runs where the task runs (the pool process on prefork), before
the task body: messages of jobs that moved on after they were published
are acknowledged and skipped, the others run once.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from celery_sched.models import JobStatus
from tests.e2e.conftest import client_for
from tests.e2e.harness import wait_for

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_deliveries_of_finished_jobs_are_skipped_the_others_run_once(
    pool: str, redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    from celery_sched.dispatch.kombu import KombuDispatcher
    from tests.e2e.app import app

    cluster = make_cluster(redis_url)
    client = client_for(e2e_settings)
    now = time.time()
    keys = [f"fence-{i}" for i in range(30)]
    client.schedule_many(
        {"task": "e2e.record", "args": [now, "fence"], "key": key, "queue": cluster.queue}
        for key in keys
    )
    store = client.store
    epoch = store.acquire_epoch(0, "fence-e2e")
    claimed = store.claim_due(shard=0, epoch=epoch, limit=100)
    assert len(claimed) == 30
    dispatcher = KombuDispatcher(app, e2e_settings)
    try:
        assert len(dispatcher.publish(claimed, epoch=epoch, now=store.now()).sent) == 30
    finally:
        dispatcher.close()
    # The jobs move on while their messages wait in the queue.
    by_key = {job.key: job for job in claimed}
    for key in keys[:10]:
        assert store.mark_finished(by_key[key].id, JobStatus.DEAD, due_at=by_key[key].due_at)
    for key in keys[10:20]:
        assert store.mark_finished(by_key[key].id, JobStatus.SUCCEEDED, due_at=by_key[key].due_at)

    worker = cluster.start_worker(pool=pool, concurrency=1 if pool == "solo" else 2)
    wait_for(lambda: cluster.run_count() >= 10, timeout=60, what="the live jobs ran")
    wait_for(
        lambda: worker.output().count("not running this delivery") >= 20,
        timeout=30,
        what="the finished jobs' deliveries skipped",
    )
    time.sleep(1)  # a late run would show up now
    assert sorted(key for _id, key, _due, _ran in cluster.runs()) == sorted(keys[20:])
    statuses = {key: store.get(key).status for key in keys}  # type: ignore[union-attr]
    assert {statuses[key] for key in keys[:10]} == {JobStatus.DEAD}
    assert {statuses[key] for key in keys[10:20]} == {JobStatus.SUCCEEDED}
    wait_for(
        lambda: {store.get(key).status for key in keys[20:]} == {JobStatus.SUCCEEDED},  # type: ignore[union-attr]
        timeout=30,
        what="the live jobs reported succeeded",
    )
