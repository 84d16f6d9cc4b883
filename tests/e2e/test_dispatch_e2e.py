"""One-off jobs reach real Celery workers from real beat processes."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

import pytest

from tests.e2e.conftest import BROKERS, broker_for, client_for, spread_jobs
from tests.e2e.harness import percentile, wait_for

pytestmark = pytest.mark.slow


def _assert_exactly_once(cluster: Any, expected_keys: set[str]) -> list[float]:
    runs = cluster.runs()
    per_key = collections.Counter(key for _id, key, _due, _ran in runs)
    duplicates = {k: n for k, n in per_key.items() if n > 1}
    assert not duplicates, f"jobs executed more than once: {list(duplicates.items())[:10]}"
    assert set(per_key) == expected_keys
    early = [(key, ran - due) for _id, key, due, ran in runs if ran < due - 0.001]
    assert not early, f"jobs ran before their due time: {early[:10]}"
    return [ran - due for _id, _key, due, ran in runs]


@pytest.mark.parametrize("broker", BROKERS)
def test_jobs_due_over_ten_seconds_run_once_each_and_never_early(
    broker: str, redis_url: str, amqp_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    cluster = make_cluster(broker_for(broker, redis_url, amqp_url))
    cluster.start_worker()
    cluster.start_beat()
    wait_for(cluster.leader, timeout=30, what="a leader")

    jobs = spread_jobs(5000, time.time() + 3, 10)
    client = client_for(e2e_settings)
    assert client.schedule_many(jobs) == 5000

    wait_for(lambda: cluster.run_count() >= 5000, timeout=90, what="5000 executions")
    time.sleep(1)  # a duplicate would show up now
    lags = _assert_exactly_once(cluster, {job["key"] for job in jobs})
    print(
        f"{broker}: lag p50={percentile(lags, 50):.3f}s "
        f"p99={percentile(lags, 99):.3f}s max={max(lags):.3f}s"
    )
    counts = client.counts_by_status()
    assert counts.get("succeeded", 0) == 5000, counts


def test_two_beats_elect_one_leader_and_publish_each_job_once(
    redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    cluster = make_cluster(redis_url)
    cluster.start_worker()
    first = cluster.start_beat("beat1")
    second = cluster.start_beat("beat2")
    epoch, holder = wait_for(cluster.leader, timeout=30, what="a leader")

    jobs = spread_jobs(3000, time.time() + 2, 6)
    client_for(e2e_settings).schedule_many(jobs)

    # Sample leadership while the jobs flow: it never changes hands.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and cluster.run_count() < 3000:
        assert cluster.leader() == (epoch, holder)
        time.sleep(0.2)
    wait_for(lambda: cluster.run_count() >= 3000, timeout=60, what="3000 executions")
    time.sleep(1)
    _assert_exactly_once(cluster, {job["key"] for job in jobs})

    leading = [p for p in (first, second) if "leading with epoch" in p.output()]
    assert len(leading) == 1, [p.name for p in leading]
    epochs = {row[0] for row in cluster.query("SELECT DISTINCT leader_epoch FROM {s}.jobs")}
    assert epochs == {epoch}


def test_beat_embedded_in_a_worker_dispatches_jobs(
    redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    cluster = make_cluster(redis_url)
    cluster.start_worker(embedded_beat=True)
    wait_for(cluster.leader, timeout=30, what="the embedded beat to lead")
    jobs = spread_jobs(200, time.time() + 1, 2, tag="embedded")
    client_for(e2e_settings).schedule_many(jobs)
    wait_for(lambda: cluster.run_count() >= 200, timeout=60, what="200 executions")
    _assert_exactly_once(cluster, {job["key"] for job in jobs})


def test_workers_without_tracking_get_each_job_once_and_it_ends_sent(
    redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    # #15 (1): a project that switches only its beat leaves its workers as
    # they are (no tracking.install). Nothing reports their runs, so the
    # reconciler must not re-send them: each job is sent once, as stock beat
    # sends it, and ends `sent` a visibility timeout later.
    settings = dataclasses.replace(e2e_settings, visibility_timeout=3.0)
    cluster = make_cluster(redis_url, settings=settings)
    cluster.start_beat()
    cluster.start_worker(E2E_TRACKING="0")
    wait_for(cluster.leader, timeout=30, what="a leader")
    jobs = spread_jobs(20, time.time() + 1, 1, tag="untracked")
    client = client_for(settings)
    client.schedule_many(jobs)
    wait_for(lambda: cluster.run_count() >= 20, timeout=60, what="20 executions")

    def statuses() -> collections.Counter[str]:
        return collections.Counter(str(client.get(job["key"]).status) for job in jobs)

    wait_for(lambda: statuses() == {"sent": 20}, timeout=30, what="every job to end sent")
    time.sleep(settings.visibility_timeout + 2 * settings.reconcile_interval)
    _assert_exactly_once(cluster, {job["key"] for job in jobs})
    assert statuses() == {"sent": 20}
