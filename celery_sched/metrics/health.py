"""``/healthz`` and ``/readyz``: is the leader loop alive, are its services up.

Liveness fails only when the loop itself stopped: no pass ended and no batch
went out for :func:`stall_limit` seconds. A PostgreSQL or Redis outage does
not fail it (the loop keeps ticking, backing off): restarting the beat would
not help. Readiness fails while PostgreSQL or Redis does not answer a fresh
connection within :data:`PROBE_TIMEOUT`; its answer is kept for
:data:`READY_TTL` seconds, so scrapes and probes do not hammer the services.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from celery_sched.leader.loop import MAX_BACKOFF

if TYPE_CHECKING:
    from celery_sched.settings import Settings

#: Seconds of slack on top of three ticks before the loop counts as stalled.
STALL_MARGIN = 5.0
#: Seconds a readiness answer is kept.
READY_TTL = 1.0
#: Seconds the readiness check waits for each service.
PROBE_TIMEOUT = 1.0


def stall_limit(settings: Settings) -> float:
    """Seconds without progress after which the loop counts as stalled:
    three of its longest sleeps (a tick, a standby's lease check, a failing
    leader's backoff), plus :data:`STALL_MARGIN`."""
    longest_sleep = max(settings.max_tick, settings.lease_ttl / 3, MAX_BACKOFF)
    return 3 * longest_sleep + STALL_MARGIN


class Liveness:
    """Whether the loop made progress within ``limit`` seconds."""

    def __init__(self, stalled_for: Callable[[], float], limit: float) -> None:
        self._stalled_for = stalled_for
        self.limit = limit

    def check(self) -> tuple[bool, str]:
        """``(alive, one line saying why)``."""
        stalled = self._stalled_for()
        if stalled > self.limit:
            return False, f"the leader loop has not ticked for {stalled:.1f}s (limit {self.limit}s)"
        return True, f"the leader loop ticked {stalled:.1f}s ago"


class Readiness:
    """Whether every service answers its probe (``probes``: name -> a call
    that raises when the service does not answer).

    Probes run on threads of their own and are waited for ``timeout``
    seconds; one that takes longer counts as failed, and is not started
    again until it returned. Answers are kept ``ttl`` seconds.
    """

    def __init__(
        self,
        probes: Mapping[str, Callable[[], None]],
        *,
        ttl: float = READY_TTL,
        timeout: float = PROBE_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._probes = dict(probes)
        self._ttl = ttl
        self._timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, len(self._probes)), thread_name_prefix="celery_sched-probe"
        )
        self._running: dict[str, concurrent.futures.Future[None]] = {}
        self._answer: tuple[float, bool, dict[str, str]] | None = None

    def check(self) -> tuple[bool, dict[str, str]]:
        """``(ready, {service: "ok" or why not})``, at most ``ttl`` seconds old."""
        with self._lock:
            now = self._clock()
            if self._answer is not None and now - self._answer[0] < self._ttl:
                return self._answer[1], dict(self._answer[2])
            for name, probe in self._probes.items():
                if name not in self._running:
                    self._running[name] = self._pool.submit(probe)
            concurrent.futures.wait(self._running.values(), timeout=self._timeout)
            found: dict[str, str] = {}
            for name, future in list(self._running.items()):
                if not future.done():
                    found[name] = f"no answer within {self._timeout}s"
                    continue
                del self._running[name]
                exc = future.exception()
                found[name] = "ok" if exc is None else f"{type(exc).__name__}: {exc}"
            ready = all(why == "ok" for why in found.values())
            self._answer = (self._clock(), ready, found)
            return ready, dict(found)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
