"""The parcels app's tasks, found by ``app.autodiscover_tasks()``."""

from __future__ import annotations

import datetime as dt
import json
import time
from typing import Any

from celery import shared_task
from django.conf import settings

from parcels.values import Parcel


def _log_run(request: Any, **fields: Any) -> None:
    entry = {
        "task": request.task,
        "id": request.id,
        "routing_key": (request.delivery_info or {}).get("routing_key"),
        "published_by": getattr(request, "x_origin", None),
        "from_beat": getattr(request, "celery_beat_task", None),
        "at": time.time(),
        **fields,
    }
    with open(settings.SHOP_RUN_LOG, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(entry) + "\n")


@shared_task(bind=True)
def collect(self: Any, parcel: Parcel) -> None:
    assert isinstance(parcel, Parcel), type(parcel)
    _log_run(
        self.request,
        parcel={
            "type": f"{type(parcel).__module__}.{type(parcel).__qualname__}",
            "ref": parcel.ref,
            "priority": parcel.priority,
            "booked_at": parcel.booked_at.isoformat(),
            "sizes": sorted(parcel.sizes),
            "sizes_type": type(parcel.sizes).__name__,
        },
    )


@shared_task(bind=True)
def count_stock(self: Any, aisles: set[str], day: dt.date) -> None:
    assert isinstance(aisles, set) and isinstance(day, dt.date)
    _log_run(
        self.request,
        stock={"aisles": sorted(aisles), "aisles_type": type(aisles).__name__, "day": repr(day)},
    )
