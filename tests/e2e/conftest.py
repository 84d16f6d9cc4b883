"""Fixtures for tests that run real beat and worker processes."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_sched.settings import Settings
from tests.e2e.harness import Cluster

BROKERS = ["redis", "amqp"]


@pytest.fixture
def e2e_settings(settings: Settings) -> Settings:
    """Short timings so failover and reconciliation fit in a test."""
    return dataclasses.replace(
        settings,
        lease_ttl=2.0,
        lease_safety_margin=0.3,
        visibility_timeout=120.0,
        sweep_interval=1.0,
        reconcile_interval=1.0,
        staging_window=20.0,
        batch_size=500,
    )


def broker_for(kind: str, redis_url: str, amqp_url: str) -> str:
    return redis_url if kind == "redis" else amqp_url


@pytest.fixture
def make_cluster(tmp_path: Path, e2e_settings: Settings) -> Iterator[Any]:
    clusters: list[Cluster] = []

    def make(broker_url: str, settings: Settings | None = None) -> Cluster:
        from celery_sched.backends import build_store

        settings = settings or e2e_settings
        store = build_store(settings)
        store.migrate()
        store.close()
        cluster = Cluster(
            tmp_path=tmp_path,
            settings=settings,
            broker_url=broker_url,
            queue="q_" + uuid.uuid4().hex[:10],
        )
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()
        # Shown by pytest only when the test failed.
        print(cluster.dump_logs())


def client_for(settings: Settings) -> Any:
    from celery_sched.client import Client
    from tests.e2e.app import app

    return Client(app, settings=settings)


def spread_jobs(count: int, start: float, seconds: float, tag: str = "") -> list[dict[str, Any]]:
    """``count`` e2e.record jobs due evenly over ``seconds`` from epoch ``start``."""
    jobs = []
    for i in range(count):
        due = start + seconds * i / max(1, count)
        jobs.append(
            {
                "task": "e2e.record",
                "args": [due, tag],
                "eta": dt.datetime.fromtimestamp(due, dt.UTC),
                "key": f"{tag or 'job'}-{i}",
            }
        )
    return jobs
