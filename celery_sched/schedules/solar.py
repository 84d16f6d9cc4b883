"""Solar schedules: sunrise, sunset and the like, from :mod:`ephem`, set up
as Celery's ``solar`` sets it up."""

from __future__ import annotations

import datetime as dt
from typing import Any, cast

from celery.schedules import solar

from celery_sched.errors import InvalidSchedule
from celery_sched.schedules.compiled import Compiled
from celery_sched.schedules.wallclock import DAY
from celery_sched.timeutil import UTC


class CompiledSolar(Compiled):
    """Solar events from ephem, observed as Celery's ``solar`` sets it up."""

    #: Days searched for an event that does not happen every day (polar
    #: night and day); none within a year means it never happens there.
    max_search_days = 366
    probe = 2 * DAY

    def __init__(self, event: str, lat: float, lon: float) -> None:
        try:
            reference: Any = solar(cast(Any, event), lat, lon)
        except Exception as exc:  # ValueError, or ImproperlyConfigured without ephem
            raise InvalidSchedule(f"invalid solar schedule: {exc}") from exc
        self.ephem: Any = reference.ephem
        self.lat, self.lon = str(lat), str(lon)
        self.horizon = reference.cal.horizon
        self.method = reference.method
        self.use_center = reference.use_center

    def _observer(self) -> Any:
        # A fresh observer per call: ephem observers are mutable, and the
        # planner may evaluate schedules from more than one thread.
        observer = self.ephem.Observer()
        observer.lat, observer.lon = self.lat, self.lon
        observer.elev = 0
        observer.horizon = self.horizon
        observer.pressure = 0
        return observer

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        ephem = self.ephem
        observer = self._observer()
        sun = ephem.Sun()
        find = getattr(observer, self.method)
        extra = {"use_center": True} if self.use_center else {}
        start = ephem.Date(after.replace(tzinfo=None))
        for _ in range(self.max_search_days):
            try:
                event = find(sun, start=start, **extra)
            except ephem.CircumpolarError:
                start = observer.next_antitransit(sun, start=start)
                continue
            # Whole seconds: keys stay short and equal across processes.
            naive: dt.datetime = event.datetime()
            instant = (naive + dt.timedelta(microseconds=500_000)).replace(
                microsecond=0, tzinfo=UTC
            )
            if instant > after:
                return instant
            start = ephem.Date(event + ephem.minute)
        return None
