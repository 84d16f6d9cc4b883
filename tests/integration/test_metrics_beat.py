"""A real ``celery beat -S celery_sched`` serves /metrics, /healthz and /readyz."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import free_port, wait_for
from tests.series import BEAT_SERIES

pytestmark = pytest.mark.slow

#: Every series a leading beat serves, with the histograms' count and sum.
SERIES = (
    *BEAT_SERIES,
    "celery_sched_dispatch_lag_seconds_count",
    "celery_sched_dispatch_lag_seconds_sum",
    "celery_sched_claim_seconds_count",
)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """``{sample name: {sorted labels: value}}`` of the beat's /metrics."""
    status, text = get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, text
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def one(samples: dict[str, Any], name: str, **labels: str) -> float:
    value: float = samples[name][tuple(sorted(labels.items()))]
    return value


def test_a_leading_beat_serves_every_series_with_live_values(
    redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    """Started with ``--metrics-port`` (which wins over the environment's port)."""
    cluster = make_cluster(redis_url)
    port, env_port = free_port(), free_port()
    beat = cluster.start_beat(
        args=("--metrics-port", str(port)), CELERY_SCHED_METRICS_PORT=str(env_port)
    )
    wait_for(cluster.leader, timeout=30, what="a leader")
    wait_for(
        lambda: get(f"http://127.0.0.1:{port}/healthz")[0] == 200,
        timeout=30,
        what="/healthz 200",
    )
    assert get(f"http://127.0.0.1:{env_port}/healthz")[0] == 0, "the flag did not win"
    first = wait_for(
        lambda: (lambda got: got if one(got, "celery_sched_leader", shard="0") == 1 else None)(
            scrape(port)
        ),
        timeout=10,
        what="celery_sched_leader 1",
    )
    assert one(first, "celery_sched_epoch", shard="0") >= 1

    client = client_for(e2e_settings)
    now = time.time()
    assert client.schedule_many(spread_jobs(200, now - 3, 0.1, tag="due")) == 200
    assert client.schedule_many(spread_jobs(5, now + 15, 1, tag="later")) == 5

    def live() -> dict[str, Any] | None:
        samples = scrape(port)
        if (
            one(samples, "celery_sched_dispatched_total", shard="0") >= 200
            and "celery_sched_staged_jobs" in samples
            and one(samples, "celery_sched_staged_jobs", shard="0") >= 5
        ):
            return samples
        return None

    samples = wait_for(live, timeout=30, what="200 jobs dispatched and 5 staged")
    missing = [name for name in SERIES if name not in samples]
    assert not missing, (missing, beat.tail())
    assert one(samples, "celery_sched_dispatch_lag_seconds_count") >= 200
    # Due three seconds before they were scheduled: no lag below that.
    assert one(samples, "celery_sched_dispatch_lag_seconds_sum") >= 200 * 2.9
    assert one(samples, "celery_sched_dispatch_lag_seconds_bucket", le="1.0") == 0
    assert one(samples, "celery_sched_claim_seconds_count") >= 1
    assert one(samples, "celery_sched_publish_failures_total", shard="0", reason="broker") == 0
    assert one(samples, "celery_sched_jobs", status="succeeded") == 0
    assert one(samples, "celery_sched_oldest_due_pending_seconds") >= 0
    assert "process_cpu_seconds_total" in samples
    # The counts by status are read every 15 s or more: wait for one after the jobs.
    wait_for(
        lambda: one(scrape(port), "celery_sched_jobs", status="dispatched") >= 200,
        timeout=40,
        what="the jobs counted dispatched",
    )

    status, text = get(f"http://127.0.0.1:{port}/readyz")
    assert status == 200, text
    assert "postgresql: ok" in text and "redis: ok" in text


def test_readyz_fails_and_healthz_holds_when_redis_does_not_answer(
    make_cluster: Any, e2e_settings: Any, redis_url: str
) -> None:
    import dataclasses

    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    cluster = make_cluster(redis_url, dataclasses.replace(e2e_settings, redis_url=nowhere))
    port = free_port()
    beat = cluster.start_beat(CELERY_SCHED_METRICS_PORT=str(port))
    status, text = wait_for(
        lambda: (lambda got: got if got[0] == 503 else None)(
            get(f"http://127.0.0.1:{port}/readyz")
        ),
        timeout=30,
        what="/readyz 503",
    )
    assert "redis: StagingUnavailable" in text, text
    assert "postgresql: ok" in text, text
    # The loop still ticks (standing by, with no lease to be had): alive.
    time.sleep(3)
    status, text = get(f"http://127.0.0.1:{port}/healthz")
    assert status == 200, (text, beat.tail())
    assert one(scrape(port), "celery_sched_leader", shard="0") == 0
    assert beat.alive


def test_a_taken_port_is_logged_naming_the_setting_and_the_beat_still_leads(
    redis_url: str, make_cluster: Any
) -> None:
    import socket

    cluster = make_cluster(redis_url)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        beat = cluster.start_beat(CELERY_SCHED_METRICS_PORT=str(port))
        wait_for(cluster.leader, timeout=30, what="a leader")
        wait_for(
            lambda: "celery_sched_metrics_port" in beat.output(),
            timeout=10,
            what="the error naming the setting",
        )
        assert beat.alive
