"""A real prefork worker serves its processes' counts on celery_sched_worker_metrics_port."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.harness import free_port, wait_for
from tests.e2e.test_worker_side_e2e import TaskCluster, make_task_cluster  # noqa: F401
from tests.integration.test_metrics_beat import get, scrape

pytestmark = pytest.mark.slow


def test_ledger_outcomes_of_every_pool_process_add_up_on_the_main_process(
    redis_url: str,
    make_task_cluster: Callable[[str], TaskCluster],  # noqa: F811
) -> None:
    cluster = make_task_cluster(redis_url)
    port = free_port()
    cluster.env["CELERY_SCHED_WORKER_METRICS_PORT"] = str(port)
    worker = cluster.start_task_worker(concurrency=2, pool="prefork")
    wait_for(
        lambda: get(f"http://127.0.0.1:{port}/metrics")[0] == 200,
        timeout=30,
        what="the worker's /metrics",
    )
    job = cluster.client.schedule("tasks.effect", ["m", 1.5], key="m", queue=cluster.queue)
    claimed, epoch = cluster.claim(job)
    publisher = cluster.publisher()
    try:
        # Two copies at once: one runs (acquired), the other finds the key
        # held; its retry comes back after the job succeeded (fenced).
        for _ in range(2):
            assert publisher.publish([claimed], epoch=epoch, now=cluster.store.now()).sent

        def counted() -> dict[str, float] | None:
            samples = scrape(port).get("celery_sched_ledger_outcomes_total", {})
            outcomes = {dict(labels)["outcome"]: value for labels, value in samples.items()}
            if all(outcomes.get(name, 0) >= 1 for name in ("acquired", "held", "fenced")):
                return outcomes
            return None

        outcomes = wait_for(counted, timeout=60, what="acquired, held and fenced counted")
    finally:
        publisher.close()
    assert outcomes["acquired"] == 1, (outcomes, worker.tail())
    samples = scrape(port)
    held = samples["celery_sched_status_reports_held"]
    assert sum(held.values()) == 0  # all written: the database is up
