"""A schedule class beat drives through ``is_due``: given seconds of every minute."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import Any

from celery.schedules import BaseSchedule, schedstate

_SECOND = dt.timedelta(seconds=1)


class AtSeconds(BaseSchedule):
    """Due at each of ``seconds`` (0-59) past every minute."""

    def __init__(self, seconds: Iterable[int], nowfun: Any = None, app: Any = None) -> None:
        self.seconds = tuple(sorted(set(seconds)))
        super().__init__(nowfun=nowfun, app=app)

    def _next_after(self, moment: dt.datetime) -> dt.datetime:
        """The first instant strictly after ``moment`` on one of the seconds."""
        candidate = moment.replace(microsecond=0) + _SECOND
        while candidate.second not in self.seconds:
            candidate += _SECOND
        return candidate

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return self._next_after(last_run_at) - self.now()

    def is_due(self, last_run_at: dt.datetime) -> schedstate:
        now = self.now()
        if self._next_after(last_run_at) <= now:
            return schedstate(True, (self._next_after(now) - now).total_seconds())
        return schedstate(False, self.remaining_estimate(last_run_at).total_seconds())

    def __reduce__(self) -> tuple[Any, ...]:
        return self.__class__, (self.seconds, self.nowfun)

    def __repr__(self) -> str:
        return f"<AtSeconds {','.join(map(str, self.seconds))}>"
