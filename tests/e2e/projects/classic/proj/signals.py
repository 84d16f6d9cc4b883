"""Publish hooks: every message says who sent it, and every send is logged."""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from celery.signals import after_task_publish, before_task_publish


def _log(entry: dict[str, Any]) -> None:
    entry["at"] = time.time()
    path = os.environ.get("PUBLISH_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")


@before_task_publish.connect
def stamp_publisher(
    sender: str | None = None, headers: dict[str, Any] | None = None, **kwargs: Any
) -> None:
    assert headers is not None
    headers["x_published_by"] = f"{socket.gethostname()}:{os.getpid()}"
    _log({"signal": "before", "task": sender, "id": headers["id"], "pid": os.getpid()})


@after_task_publish.connect
def log_publish(
    sender: str | None = None,
    headers: dict[str, Any] | None = None,
    routing_key: str | None = None,
    **kwargs: Any,
) -> None:
    assert headers is not None
    _log(
        {
            "signal": "after",
            "task": sender,
            "id": headers["id"],
            "pid": os.getpid(),
            "routing_key": routing_key,
            "published_by": headers.get("x_published_by"),
        }
    )
