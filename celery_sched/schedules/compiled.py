"""What every kind of schedule evaluates to: a :class:`Compiled` definition.

Each kind (:mod:`~celery_sched.schedules.cron`,
:mod:`~celery_sched.schedules.interval`, :mod:`~celery_sched.schedules.solar`,
:mod:`~celery_sched.schedules.clocked_time`) parses its definition once into
a subclass; :func:`celery_sched.schedules.evaluate.compile_spec` picks and
caches it.
"""

from __future__ import annotations

import collections
import datetime as dt

from celery_sched.schedules.wallclock import HOUR, MICROSECOND


class Compiled:
    """A spec's definition parsed once; evaluates instants (aware UTC)."""

    #: Width of the first window :meth:`latest` searches, doubled as needed.
    probe = HOUR

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        raise NotImplementedError

    def anchor(self, now: dt.datetime) -> dt.datetime:
        """The instant whose :meth:`next_after` is the first occurrence of a
        schedule with no history, planned at ``now``."""
        return now

    def count(self, cursor: dt.datetime, cutoff: dt.datetime) -> int:
        """How many occurrences lie strictly between ``cursor`` and ``cutoff``."""
        total = 0
        moment = self.next_after(cursor)
        while moment is not None and moment < cutoff:
            total += 1
            moment = self.next_after(moment)
        return total

    def latest(
        self, cursor: dt.datetime, floor: dt.datetime | None, cutoff: dt.datetime, n: int
    ) -> list[dt.datetime]:
        """The latest ``n`` occurrences after ``cursor``, at or after ``floor``
        (if given) and before ``cutoff``, ascending.

        Searches windows ending at ``cutoff``, growing fourfold, so the work
        depends on how many occurrences are wanted, not on how far back
        ``cursor`` lies.
        """
        if n <= 0:
            return []
        low = cursor if floor is None or floor <= cursor else floor - MICROSECOND
        width = self.probe
        while True:
            try:
                start = max(low, cutoff - width)
            except OverflowError:
                start = low
            found: collections.deque[dt.datetime] = collections.deque(maxlen=n)
            moment = self.next_after(start)
            while moment is not None and moment < cutoff:
                found.append(moment)
                moment = self.next_after(moment)
            if len(found) == n or start == low:
                return list(found)
            width *= 4
