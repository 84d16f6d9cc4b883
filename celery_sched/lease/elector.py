"""The leader election: who may dispatch a shard, and until when.

:class:`LeaderElector` wraps a :class:`~celery_sched.interfaces.LeaseBackend`
(Redis in production, :class:`~celery_sched.lease.memory.MemoryLeaseBackend`
in unit tests) and the store's epoch bump. It renews the lease on its own
daemon thread, never inside the dispatch loop, so a slow batch cannot let the
lease lapse.

Two clocks, two jobs:

* Redis decides when the lease expires (``PX``), so two processes never hold
  the key at once.
* Locally, a leader trusts its lease only until ``valid_until``: the
  monotonic time taken *before* the SET/renewal was sent, plus ``ttl``, minus
  ``safety_margin``. Redis started counting ``ttl`` no earlier than that
  instant, so the local deadline always falls before the key expires, and a
  paused or partitioned process stops claiming on its own, before anybody
  else can be elected.

Claims are fenced by the epoch that ``acquire_epoch`` bumps in PostgreSQL,
so even a leader that misjudges its deadline cannot claim rows after a
successor was elected.

The dispatch loop uses only :meth:`LeaderElector.is_leader`,
:meth:`LeaderElector.current` and :meth:`LeaderElector.wait_changed`; none of
them touches Redis, so they never block on it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable

from celery_sched.errors import LeaseError
from celery_sched.interfaces import LeaseBackend
from celery_sched.models import Lease

__all__ = ["LeaderElector", "LeaseCallback", "lease_token", "token_holder"]

logger = logging.getLogger(__name__)

LeaseCallback = Callable[[Lease], None]
"""Called with the lease that was won (``on_elected``) or lost (``on_lost``)."""


def lease_token(holder: str) -> str:
    """A new lease token of ``holder`` (``host:pid``): unique per election,
    and saying who holds the lease (:func:`token_holder`)."""
    return f"{holder}:{uuid.uuid4().hex}"


def token_holder(token: str) -> str:
    """The ``holder`` a :func:`lease_token` was made for."""
    return token.rpartition(":")[0] or token


class LeaderElector:
    """Competes for one shard's lease and keeps it while it can.

    ``acquire_epoch(shard, holder)`` is the store call that bumps the shard's
    fencing epoch (:meth:`~celery_sched.interfaces.JobStore.acquire_epoch`);
    it is injected so this module never touches SQL.

    Role changes are announced two ways, use either:

    * ``on_elected(lease)`` / ``on_lost(lease)`` callbacks, run on the thread
      that noticed the change (usually the elector's own thread). They must
      be quick; an exception in one is logged and ignored.
    * :meth:`wait_changed`, for a loop that sleeps until something happens.

    A lease that merely runs past its local deadline (the renewing thread is
    stuck, the process was paused) is not announced: nothing is awake to
    notice it. :meth:`is_leader` already answers ``False`` then, so check it
    before every claim.

    When a claim raises :class:`~celery_sched.errors.StaleEpoch`, another
    leader was elected behind this one's back: call :meth:`release` to step
    down; the background thread competes again on its next tick.
    """

    def __init__(
        self,
        backend: LeaseBackend,
        *,
        shard: int,
        ttl: float,
        safety_margin: float,
        acquire_epoch: Callable[[int, str], int],
        holder: str,
        clock: Callable[[], float] = time.monotonic,
        on_elected: LeaseCallback | None = None,
        on_lost: LeaseCallback | None = None,
        standby_interval: float | None = None,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl!r}")
        if not 0 <= safety_margin < ttl:
            raise ValueError(
                f"safety_margin must be in [0, ttl), got {safety_margin!r} for ttl {ttl!r}"
            )
        if not holder:
            raise ValueError("holder must name this process")
        self._backend = backend
        self._shard = shard
        self._ttl = ttl
        self._margin = safety_margin
        self._acquire_epoch = acquire_epoch
        self._holder = holder
        self._clock = clock
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._standby_interval = ttl / 3 if standby_interval is None else standby_interval
        if self._standby_interval <= 0:
            raise ValueError(f"standby_interval must be positive, got {standby_interval!r}")

        # Replaced wholesale, never mutated, so readers need no lock.
        self._lease: Lease | None = None
        # The token of a lease given up because the backend failed mid-renewal:
        # it may still sit in Redis, and freeing it spares a wait of one ttl.
        self._orphan: str | None = None
        # Serialises backend calls: the thread's renewal and the loop's
        # release() must not interleave (a renewal finishing after a release
        # would resurrect the lease locally).
        self._op_lock = threading.RLock()
        self._changed = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # -- properties ---------------------------------------------------------

    @property
    def shard(self) -> int:
        return self._shard

    @property
    def holder(self) -> str:
        return self._holder

    @property
    def ttl(self) -> float:
        return self._ttl

    @property
    def interval(self) -> float:
        """Seconds between renewals (while leading)."""
        return self._ttl / 3

    @property
    def standby_interval(self) -> float:
        """Seconds between acquisition attempts (standing by); ``ttl / 3``
        unless given."""
        return self._standby_interval

    # -- reading the role (never touches the backend) -------------------------

    def current(self) -> Lease | None:
        """The held lease while it is locally valid, else ``None``."""
        lease = self._lease
        if lease is not None and self._clock() < lease.valid_until:
            return lease
        return None

    def is_leader(self) -> bool:
        """True while a lease is held and its local deadline has not passed."""
        return self.current() is not None

    def wait_changed(self, timeout: float | None = None) -> bool:
        """Block until the role changed (elected or lost), or ``timeout`` passed.

        Returns ``True`` when a change happened since the previous call. Meant
        for one waiting loop: it consumes the notification, so read
        :meth:`is_leader` / :meth:`current` afterwards for the present role
        (several quick changes may fold into one wake-up).
        """
        changed = self._changed.wait(timeout)
        if changed:
            self._changed.clear()
        return changed

    # -- operations (each touches the backend) --------------------------------

    def try_acquire(self) -> Lease | None:
        """Try once to become leader; never raises.

        Returns the lease (already held and renewed, or newly won), or ``None``
        when another process holds it, the backend is unreachable, or the
        epoch bump failed (the Redis lease is then released again so a
        healthier process can lead).
        """
        with self._op_lock:
            # Already holding: keep it (renewing) rather than queueing behind
            # our own key until it expires.
            if self._lease is not None and self.renew():
                return self._lease
            if self._orphan is not None:
                orphan, self._orphan = self._orphan, None
                self._release_quietly(orphan)
            token = lease_token(self._holder)
            # Taken before SET: Redis starts the ttl no earlier than this.
            t0 = self._clock()
            try:
                won = self._backend.acquire(self._shard, token, self._ttl)
            except LeaseError as exc:
                logger.warning(
                    "shard %d: cannot reach the lease backend to acquire: %s", self._shard, exc
                )
                return None
            except Exception:
                # A backend bug must not kill the caller (the lease thread).
                logger.exception("shard %d: unexpected error acquiring the lease", self._shard)
                return None
            if not won:
                logger.debug("shard %d: lease is held elsewhere; standing by", self._shard)
                return None
            try:
                epoch = self._acquire_epoch(self._shard, self._holder)
            except Exception as exc:
                # Leading without a fresh epoch would have every claim fenced
                # off; free the shard for a process that can reach the store.
                logger.warning(
                    "shard %d: won the lease but the epoch bump failed (%s: %s); "
                    "releasing it and standing by",
                    self._shard,
                    type(exc).__name__,
                    exc,
                )
                self._release_quietly(token)
                return None
            lease = Lease(
                shard=self._shard,
                token=token,
                epoch=epoch,
                valid_until=t0 + self._ttl - self._margin,
            )
            self._lease = lease
        logger.info("shard %d: elected leader as %s (epoch %d)", self._shard, self._holder, epoch)
        self._announce(self._on_elected, lease)
        return lease

    def renew(self) -> bool:
        """Extend the held lease; on any failure step down. Never raises.

        Returns ``True`` when the lease was extended. ``False`` when none was
        held, another process holds it now, or the backend is unreachable; in
        the last two cases the lease is dropped locally.
        """
        with self._op_lock:
            lease = self._lease
            if lease is None:
                return False
            t0 = self._clock()
            try:
                renewed = self._backend.renew(self._shard, lease.token, self._ttl)
                reason = "the lease is held by another process"
            except LeaseError as exc:
                # We cannot prove we still hold it, so we must assume not.
                renewed = False
                reason = f"the lease backend failed: {exc}"
                self._orphan = lease.token
            except Exception as exc:
                logger.exception("shard %d: unexpected error renewing the lease", self._shard)
                renewed = False
                reason = f"unexpected {type(exc).__name__}"
                self._orphan = lease.token
            if renewed:
                self._lease = dataclasses.replace(lease, valid_until=t0 + self._ttl - self._margin)
                return True
            self._lease = None
        logger.warning("shard %d: lost leadership (epoch %d): %s", self._shard, lease.epoch, reason)
        self._announce(self._on_lost, lease)
        return False

    def release(self) -> None:
        """Step down: stop trusting the lease, then free it (best effort)."""
        with self._op_lock:
            if self._orphan is not None:
                orphan, self._orphan = self._orphan, None
                self._release_quietly(orphan)
            lease = self._lease
            if lease is None:
                return
            # Drop locally first so nothing claims after the key is gone.
            self._lease = None
            self._release_quietly(lease.token)
        logger.info("shard %d: stepped down (epoch %d)", self._shard, lease.epoch)
        self._announce(self._on_lost, lease)

    # -- background thread ------------------------------------------------------

    def start(self) -> None:
        """Start the daemon thread that renews (leader) or competes (standby).

        Every ``ttl / 3`` seconds it renews the held lease, or tries to win
        it. It survives every exception and never ends the process.
        Idempotent while running.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping.clear()
        self._thread = threading.Thread(
            target=self._run, name=f"celery_sched-lease-{self._shard}", daemon=True
        )
        self._thread.start()

    def stop(self, *, release: bool = True, timeout: float | None = None) -> None:
        """Stop the thread and wait for it; then release the lease.

        ``release=False`` leaves the lease to expire in Redis, as if the
        process had been killed. ``timeout`` bounds the wait for the thread
        (default: one ttl, more than any single backend call may take).
        """
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._ttl if timeout is None else timeout)
            if thread.is_alive():
                logger.warning("shard %d: the lease thread did not stop in time", self._shard)
        self._thread = None
        if release:
            self.release()

    def _run(self) -> None:
        logger.debug("shard %d: lease thread started for %s", self._shard, self._holder)
        while not self._stopping.is_set():
            period = self.interval if self._lease is not None else self._standby_interval
            delay = period
            try:
                started = self._clock()
                if self._lease is not None:
                    self.renew()
                else:
                    self.try_acquire()
                # Count from the tick's start, so a slow call does not
                # stretch the renewal period past ttl / 3.
                delay = min(period, max(0.0, period - (self._clock() - started)))
            except Exception:
                # The thread must outlive any surprise, or the lease would
                # lapse silently; the next tick tries again.
                logger.exception("shard %d: unexpected error in the lease thread", self._shard)
            self._stopping.wait(delay)
        logger.debug("shard %d: lease thread stopped", self._shard)

    # -- helpers ------------------------------------------------------------------

    def _release_quietly(self, token: str) -> None:
        try:
            self._backend.release(self._shard, token)
        except LeaseError as exc:
            # The key expires by itself within ttl.
            logger.warning("shard %d: could not release the lease: %s", self._shard, exc)
        except Exception:
            logger.exception("shard %d: unexpected error releasing the lease", self._shard)

    def _announce(self, callback: LeaseCallback | None, lease: Lease) -> None:
        self._changed.set()
        if callback is None:
            return
        try:
            callback(lease)
        except Exception:
            logger.exception("shard %d: lease callback %r failed", self._shard, callback)
