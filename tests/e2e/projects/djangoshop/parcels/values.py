"""What the tasks are given: plain objects, carried by pickle."""

from __future__ import annotations

import dataclasses
import datetime as dt


@dataclasses.dataclass
class Parcel:
    ref: str
    priority: bool
    booked_at: dt.datetime
    sizes: set[str]
