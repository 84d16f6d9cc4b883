"""The store's time as the leader reads it, without asking for it each time.

Store time is the last time read from the store plus the monotonic time
since, never the local wall clock: a wall-clock step on the beat host cannot
make a job look due or expired early.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore


class StoreClock:
    """The store's clock, extrapolated with the monotonic ``clock``.

    :meth:`now` never runs ahead of the store's clock: an id popped as due
    is due by Postgres too when it is claimed. It only reads the store when
    nothing was measured yet; :meth:`measure` reads it on purpose (the
    stager does, once per pass). Either raises what ``store.now()`` raises.
    """

    def __init__(self, store: JobStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        # (monotonic time, store time read just before it).
        self._base: tuple[float, dt.datetime] | None = None

    @property
    def measured(self) -> bool:
        """Whether the store's time was read at least once."""
        return self._base is not None

    def now(self) -> dt.datetime:
        """Best estimate of the store's clock that never runs ahead of it:
        the last time read from the store plus the monotonic time since."""
        if self._base is None:
            return self.measure()
        at, store_time = self._base
        return store_time + dt.timedelta(seconds=max(0.0, self._clock() - at))

    def monotonic(self) -> float:
        """The local monotonic clock this one extrapolates with."""
        return self._clock()

    def measure(self) -> dt.datetime:
        """Read the store's time now and extrapolate from it from here on."""
        store_time = self._store.now()
        # Taken after the reply: the extrapolation then trails the store's
        # clock by the round trip, never leads it.
        self._base = (self._clock(), store_time)
        return store_time
