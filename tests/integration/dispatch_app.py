"""A small Celery app run by the real worker subprocess of the dispatch tests.

Configured from the environment so the test process and the worker agree:
``DISPATCH_TEST_BROKER`` (broker URL), ``DISPATCH_TEST_REDIS`` (where results
are recorded), ``DISPATCH_TEST_RESULTS`` (the Redis list key) and
``DISPATCH_TEST_ROUTED_QUEUE`` (the queue ``task_routes`` sends
``dispatch_app.routed`` to).
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery, Task

ROUTED_TASK = "dispatch_app.routed"
RECORD_TASK = "dispatch_app.record"


def make_app(broker: str, routed_queue: str) -> Celery:
    app = Celery("dispatch_app", broker=broker, set_as_current=False)
    app.conf.update(
        task_routes={ROUTED_TASK: {"queue": routed_queue}},
        task_ignore_result=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        # A queue declared with priorities on RabbitMQ; Redis emulates them.
        task_queue_max_priority=10,
    )
    return app


app = make_app(
    os.environ.get("DISPATCH_TEST_BROKER", "redis://127.0.0.1:6379/0"),
    os.environ.get("DISPATCH_TEST_ROUTED_QUEUE", "dispatch_routed"),
)


def _record(task: Task, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    request = task.request
    delivery = request.delivery_info or {}
    entry = {
        "task": task.name,
        "id": request.id,
        "root_id": request.root_id,
        "args": list(args),
        "kwargs": kwargs,
        "key": getattr(request, "celery_sched_key", None),
        "attempt": getattr(request, "celery_sched_attempt", None),
        "epoch": getattr(request, "celery_sched_epoch", None),
        "beat": getattr(request, "celery_beat_task", None),
        "custom": getattr(request, "x_custom", None),
        "origin": request.origin,
        "priority": delivery.get("priority"),
        "routing_key": delivery.get("routing_key"),
        "hostname": request.hostname,
    }
    client = redis.Redis.from_url(os.environ.get("DISPATCH_TEST_REDIS", "redis://127.0.0.1:6379/0"))
    try:
        client.rpush(os.environ["DISPATCH_TEST_RESULTS"], json.dumps(entry))
    finally:
        client.close()


@app.task(name=RECORD_TASK, bind=True)
def record(self: Task, *args: Any, **kwargs: Any) -> None:
    _record(self, args, kwargs)


@app.task(name=ROUTED_TASK, bind=True)
def routed(self: Task, *args: Any, **kwargs: Any) -> None:
    _record(self, args, kwargs)
