"""An interval schedule aligned to the clock, like ``schedule`` but on fixed marks."""

from __future__ import annotations

import datetime as dt

from celery.schedules import schedstate, schedule

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class OnTheGrid(schedule):
    """Due on every multiple of ``run_every`` since the epoch (a 4 s schedule
    fires at :00, :04, :08, ...), whenever beat started."""

    def _next_mark(self, moment: dt.datetime) -> dt.datetime:
        marks = (moment - _EPOCH) // self.run_every
        return _EPOCH + (marks + 1) * self.run_every

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return self._next_mark(last_run_at) - self.now()

    def is_due(self, last_run_at: dt.datetime) -> schedstate:
        now = self.now()
        if self._next_mark(last_run_at) <= now:
            return schedstate(True, (self._next_mark(now) - now).total_seconds())
        return schedstate(False, self.remaining_estimate(last_run_at).total_seconds())

    def __repr__(self) -> str:
        return f"<OnTheGrid every {self.run_every.total_seconds():g}s>"
