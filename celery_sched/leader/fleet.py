"""A beat process's shards: one :class:`~celery_sched.leader.Engine` per
shard it competes for, and the balancing that decides which.

Beats without a pinned shard (``celery_sched_shard`` unset, the default)
share the ``celery_sched_shards`` shards between them:

1. every ``ttl / 6`` seconds, on a thread of its own, each beat lists itself
   as alive and reads back who else is (:mod:`celery_sched.lease.membership`;
   listed for one lease ttl), and who holds each shard's lease now;
2. on the loop's thread, at the same pace, it computes the shards each live
   beat should lead (:func:`celery_sched.leader.balancing.assign`, the same
   answer in every beat: a shard stays with its leader while that beat has
   room) and keeps an engine competing for each of its own;
3. a shard assigned elsewhere is handed over: if this beat leads it and it
   has been assigned elsewhere for ``ttl / 3`` (so a blip in the membership
   moves nothing), its engine is stopped between two passes: the
   pass in progress has finished, every batch it claimed is published, and
   the lease is released with a compare-and-delete. The new owner's elector
   wins it at its next attempt (a standby tries every ``ttl / 6``) and bumps
   the epoch, so nothing is fenced mid-batch and the shard goes unled for
   about ``ttl / 6`` at most.

When a beat dies, its listing and its leases run out after one ttl; the next
balancing of the others (within ``ttl / 6``) gives its shards to them, and
their electors take the leases at once, or at their next attempt: led again
within about ``ttl * 4 / 3`` of the last renewal. When the membership cannot
be read (Redis is down), a beat keeps the engines it has; the leases decide
as always.

A pinned beat runs one engine for its shard and takes no part in the
membership; balanced beats may compete with it for that shard (the lease
keeps one leader). Shard 0's leader does the fleet-wide duties (planning's
static sync, pruning, rehoming, the backlog reading), whichever beat it is.

The engines run one after another on the caller's thread (beat's), sharing
the store, the Redis client and the broker connection; each has its own lease
thread, its own claim-ahead threads and its counters (kept across a shard's
departures and returns, so the metrics count per process, as counters must).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery_sched.errors import CelerySchedError
from celery_sched.interfaces import Membership
from celery_sched.leader.balancing import assign, shards_of
from celery_sched.leader.loop import Engine
from celery_sched.leader.stats import EngineStats

__all__ = ["Fleet", "holder_of"]

logger = logging.getLogger(__name__)

EngineFactory = Callable[[int, EngineStats], Engine]
"""Builds the (not yet started) engine of a shard, with the counters to use."""

LeaderReader = Callable[[int], dict[int, str | None]]
"""Reads who holds each of ``shards`` shards' leases: ``shard -> holder``
(``host:pid``, as in the lease token) or ``None``; raises
:class:`~celery_sched.errors.CelerySchedError` when it cannot."""


def holder_of(beat_id: str) -> str:
    """The lease holder name (``host:pid``) of a beat id (``host:pid:random``)."""
    return beat_id.rpartition(":")[0] or beat_id


class Fleet:
    """Every engine of this beat process, and the balancing of the shards."""

    def __init__(
        self,
        *,
        make_engine: EngineFactory,
        shards: int,
        pinned: int | None,
        membership: Membership | None,
        beat_id: str,
        leaders: LeaderReader | None = None,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
        on_stop: Callable[[], None] | None = None,
        background: bool = True,
    ) -> None:
        if pinned is None and membership is None:
            raise ValueError("beats that share the shards need a membership")
        self._make_engine = make_engine
        self.shards = shards
        self.pinned = pinned
        self.beat_id = beat_id
        self._membership = membership
        self._read_leaders = leaders
        self._ttl = ttl
        self._clock = clock
        self._on_stop = on_stop
        # False: no heartbeat thread; the caller calls heartbeat() (tests).
        self._background = background
        #: Seconds between balancings (and membership heartbeats): twice per
        #: renewal period, so a dead beat's shards move soon after its leases
        #: run out.
        self.interval = ttl / 6
        #: How long a shard this beat leads must stay assigned elsewhere
        #: before it is handed over (a blip in the membership moves nothing).
        self.handover_delay = ttl / 3
        self._engines: dict[int, Engine] = {}
        # Engines stopped here: kept for their counters (metrics) until the
        # shard comes back.
        self._retired: dict[int, Engine] = {}
        # When each shard this beat runs was first seen assigned elsewhere.
        self._elsewhere_since: dict[int, float] = {}
        self._next_balance = 0.0
        # The heartbeat thread's last reading: live beat ids, the shards'
        # leaders among them, and when.
        self._live: list[str] | None = None
        self._leaders: dict[int, str] = {}
        self._live_at = 0.0
        self._live_lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self.progress_at = clock()

    # -- reading ------------------------------------------------------------

    @property
    def engines(self) -> dict[int, Engine]:
        """The running engines, by shard (a copy)."""
        return dict(self._engines)

    def all_engines(self) -> list[Engine]:
        """Running and retired engines, one per shard this process ever ran
        (the metrics read their counters)."""
        merged = {**self._retired, **self._engines}
        return [merged[shard] for shard in sorted(merged)]

    def leading(self) -> list[int]:
        """The shards whose engine leads right now."""
        return sorted(shard for shard, engine in self._engines.items() if engine.epoch is not None)

    def live_beats(self) -> list[str] | None:
        """The live beats last read (``None``: never read, or pinned)."""
        with self._live_lock:
            return None if self._live is None else list(self._live)

    def stalled_for(self) -> float:
        """Seconds since the loop last showed progress (see
        :meth:`Engine.stalled_for`): the most stalled engine, or the fleet's
        own pass when it runs none."""
        own = max(0.0, self._clock() - self.progress_at)
        # (An engine in a long pass shows progress a batch at a time.)
        return min([own, *(engine.stalled_for() for engine in self._engines.values())])

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Join the fleet (or start the pinned shard's engine)."""
        if self.pinned is not None:
            self._run_engine(self.pinned)
            return
        self.heartbeat()
        if not self._background:
            return
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._heartbeats, name="celery_sched-beats", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop every engine (releasing its lease) and leave the fleet."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(self._ttl)
        try:
            for shard in list(self._engines):
                self._stop_engine(shard, why="beat stopping")
            if self._membership is not None:
                try:
                    self._membership.leave(self.beat_id)
                except CelerySchedError as exc:
                    logger.warning("celery_sched: could not leave the beat membership: %s", exc)
        finally:
            if self._on_stop is not None:
                self._on_stop()

    # -- the loop -----------------------------------------------------------

    def step(self) -> float:
        """Balance if due, then one pass of every engine; the seconds to sleep."""
        now = self._clock()
        if self.pinned is None and now >= self._next_balance:
            self._next_balance = now + self.interval
            try:
                self.balance()
            except Exception:
                logger.exception("celery_sched: balancing the shards failed; retrying")
        delays = [self._next_balance - self._clock()] if self.pinned is None else []
        for engine in list(self._engines.values()):
            delays.append(engine.step())
        self.progress_at = self._clock()
        if not delays:
            return self.interval
        return max(0.0, min(delays))

    def balance(self) -> None:
        """Start engines for the shards assigned to this beat; hand over the
        ones assigned elsewhere (see the module's docstring)."""
        reading = self._fresh_live()
        if reading is None:
            return
        live, leaders = reading
        mine = shards_of(assign(self.shards, [*live, self.beat_id], leaders), self.beat_id)
        now = self._clock()
        for shard in sorted(mine - set(self._engines)):
            self._run_engine(shard)
        for shard in sorted(set(self._engines) - mine):
            engine = self._engines[shard]
            if engine.epoch is None and not engine.elector.is_leader():
                # Only competing: nothing to hand over.
                self._stop_engine(shard, why="assigned to another beat")
                continue
            since = self._elsewhere_since.setdefault(shard, now)
            if now - since >= self.handover_delay - 1e-9:
                self._stop_engine(shard, why="handed over to another beat")
        for shard in mine:
            self._elsewhere_since.pop(shard, None)

    # -- helpers ------------------------------------------------------------

    def _fresh_live(self) -> tuple[list[str], dict[int, str]] | None:
        """The live beats and the shards' leaders among them, if read within
        one ttl; else ``None`` (keep what runs)."""
        with self._live_lock:
            if self._live is None or self._clock() - self._live_at > self._ttl:
                return None
            return list(self._live), dict(self._leaders)

    def heartbeat(self) -> None:
        """List this beat as alive and read the others (the heartbeat thread
        does it every ``interval``); logs, never raises, when Redis is down."""
        if self._membership is None:
            return
        started = self._clock()
        try:
            live = self._membership.heartbeat(self.beat_id, self._ttl)
            holders = {} if self._read_leaders is None else self._read_leaders(self.shards)
        except CelerySchedError as exc:
            logger.warning(
                "celery_sched: cannot list this beat as alive or read the shards' leaders "
                "(%s); keeping its shards",
                exc,
            )
            return
        beats = {holder_of(beat): beat for beat in live}
        leaders = {
            shard: beats[holder]
            for shard, holder in holders.items()
            if holder is not None and holder in beats
        }
        with self._live_lock:
            self._live, self._leaders, self._live_at = live, leaders, started

    def _heartbeats(self) -> None:
        while not self._stopping.wait(self.interval):
            try:
                self.heartbeat()
            except Exception:
                logger.exception("celery_sched: unexpected error in the beats heartbeat")

    def _run_engine(self, shard: int) -> None:
        # A shard that comes back counts on from where it stopped.
        retired = self._retired.get(shard)
        engine = self._make_engine(shard, EngineStats() if retired is None else retired.stats)
        self._retired.pop(shard, None)
        self._engines[shard] = engine
        engine.start()
        logger.info("celery_sched: competing for shard %d", shard)

    def _stop_engine(self, shard: int, *, why: str) -> None:
        engine = self._engines.pop(shard)
        self._elsewhere_since.pop(shard, None)
        try:
            engine.stop()
        except Exception:
            logger.exception("celery_sched: stopping shard %d's engine failed", shard)
        self._retired[shard] = engine
        logger.info("celery_sched: shard %d released (%s)", shard, why)
