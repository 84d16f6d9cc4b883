"""The tasks. Each run is appended to the run log (``RUN_LOG``) as one JSON line."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from typing import Any

from proj.celery import app
from proj.models import Parcel


def _log_run(request: Any, **fields: Any) -> None:
    entry = {
        "task": request.task,
        "id": request.id,
        "routing_key": (request.delivery_info or {}).get("routing_key"),
        "published_by": getattr(request, "x_published_by", None),
        "from_beat": getattr(request, "celery_beat_task", None),
        "at": time.time(),
        **fields,
    }
    with open(os.environ["RUN_LOG"], "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


@app.task(bind=True)
def pickup(self: Any, parcel: Parcel) -> str:
    assert isinstance(parcel, Parcel), type(parcel)
    assert isinstance(parcel.ready_at, dt.datetime) and parcel.ready_at.tzinfo is not None
    _log_run(
        self.request,
        parcel={
            "type": f"{type(parcel).__module__}.{type(parcel).__qualname__}",
            "ref": parcel.ref,
            "express": parcel.express,
            "ready_at": parcel.ready_at.isoformat(),
            "labels": sorted(parcel.labels),
            "labels_type": type(parcel.labels).__name__,
        },
    )
    return parcel.ref


@app.task(bind=True)
def audit(self: Any, *, urgent: bool, since: dt.datetime, depots: set[str]) -> int:
    assert isinstance(since, dt.datetime) and isinstance(depots, set)
    _log_run(
        self.request,
        audit={
            "urgent": urgent,
            "since": since.isoformat(),
            "depots": sorted(depots),
            "depots_type": type(depots).__name__,
        },
    )
    return len(depots)
