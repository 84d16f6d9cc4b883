"""Helpers of the end-to-end and fault tests.

Their fixtures (``e2e_settings``, ``make_cluster``) live with the other
service fixtures in ``tests/conftest.py``; the process harness is
``tests/e2e/harness.py``.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from celery_sched.settings import Settings

BROKERS = ["redis", "amqp"]


def broker_for(kind: str, redis_url: str, amqp_url: str) -> str:
    return redis_url if kind == "redis" else amqp_url


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
