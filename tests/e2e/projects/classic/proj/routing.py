"""Routing by the arguments: urgent work goes to the express queue."""

from __future__ import annotations

import os
from typing import Any

from proj.models import Parcel

EXPRESS = os.environ.get("QUEUE_PREFIX", "") + "express"
STANDARD = os.environ.get("QUEUE_PREFIX", "") + "standard"


def route_by_urgency(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, str] | None:
    if not name.startswith("proj.tasks."):
        return None
    parcels = [value for value in (*args, *kwargs.values()) if isinstance(value, Parcel)]
    urgent = any(parcel.express for parcel in parcels) or kwargs.get("urgent") is True
    return {"queue": EXPRESS if urgent else STANDARD}
