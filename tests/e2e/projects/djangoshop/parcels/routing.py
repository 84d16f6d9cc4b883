"""Priority parcels go to the priority queue; the rest to the economy one."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from parcels.values import Parcel


def route_by_priority(
    name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **kw: Any
) -> dict[str, str] | None:
    if not name.startswith("parcels."):
        return None
    parcels = [value for value in (*args, *kwargs.values()) if isinstance(value, Parcel)]
    lane = "priority" if any(parcel.priority for parcel in parcels) else "economy"
    return {"queue": settings.SHOP_QUEUE_PREFIX + lane}
