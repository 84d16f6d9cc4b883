"""A real Flower process shows jobs dispatched by celery_sched."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from typing import Any

import pytest

from tests.e2e.conftest import client_for, spread_jobs
from tests.e2e.harness import wait_for

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_flower_lists_dispatched_tasks_with_name_args_and_client(
    redis_url: str, make_cluster: Any, e2e_settings: Any
) -> None:
    cluster = make_cluster(redis_url)
    port = _free_port()
    cluster.start_flower(port)
    cluster.start_beat()
    wait_for(cluster.leader, timeout=30, what="a leader")

    def api_tasks() -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tasks", timeout=2) as r:
                return dict(json.loads(r.read()))
        except OSError:
            return {}

    wait_for(lambda: api_tasks() is not None and _up(port), timeout=30, what="flower")
    time.sleep(1)  # let Flower's event receiver attach before we publish
    jobs = spread_jobs(20, time.time() + 1, 1, tag="flower")
    client_for(e2e_settings).schedule_many(jobs)
    ids = {str(client_for(e2e_settings).get(job["key"]).id) for job in jobs}

    tasks = wait_for(
        lambda: (t := api_tasks()) and ids <= set(t) and t,
        timeout=30,
        what="flower to list every task",
    )
    for task_id in ids:
        task = tasks[task_id]
        assert task["name"] == "e2e.record"
        assert "flower" in task["args"]
        assert task["client"] == e2e_settings.hostname


def _up(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
