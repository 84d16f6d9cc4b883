"""The project's value objects, sent to tasks as they are (pickle)."""

from __future__ import annotations

import dataclasses
import datetime as dt


@dataclasses.dataclass(frozen=True)
class Parcel:
    ref: str
    express: bool
    ready_at: dt.datetime
    labels: frozenset[str]
