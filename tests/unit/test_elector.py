"""LeaderElector on the in-memory lease backend.

Most tests drive a fake clock by hand; the thread tests use real time with a
small ttl.
"""

from __future__ import annotations

import functools
import logging
import threading
import time

import pytest

from celery_sched.errors import StoreUnavailable
from celery_sched.interfaces import LeaseBackend
from celery_sched.lease.elector import LeaderElector
from celery_sched.lease.memory import MemoryLeaseBackend
from celery_sched.models import Lease

TTL = 9.0
MARGIN = 0.5


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Epochs:
    """Stands in for JobStore.acquire_epoch: a per-shard counter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epochs: dict[int, int] = {}
        self.holders: list[str] = []
        self.down = False

    def __call__(self, shard: int, holder: str) -> int:
        if self.down:
            raise StoreUnavailable()
        with self._lock:
            self.epochs[shard] = self.epochs.get(shard, 0) + 1
            self.holders.append(holder)
            return self.epochs[shard]


class SlowBackend(LeaseBackend):
    """Each call takes ``delay`` seconds of the fake clock (a slow network)."""

    def __init__(self, inner: LeaseBackend, clock: FakeClock, delay: float) -> None:
        self.inner = inner
        self.clock = clock
        self.delay = delay

    def acquire(self, shard: int, token: str, ttl: float) -> bool:
        self.clock.advance(self.delay)
        return self.inner.acquire(shard, token, ttl)

    def renew(self, shard: int, token: str, ttl: float) -> bool:
        self.clock.advance(self.delay)
        return self.inner.renew(shard, token, ttl)

    def release(self, shard: int, token: str) -> bool:
        return self.inner.release(shard, token)

    def holder(self, shard: int) -> str | None:
        return self.inner.holder(shard)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def backend(clock: FakeClock) -> MemoryLeaseBackend:
    return MemoryLeaseBackend(clock)


@pytest.fixture
def epochs() -> Epochs:
    return Epochs()


def make(
    backend: LeaseBackend,
    clock: FakeClock,
    epochs: Epochs,
    holder: str = "beat-a",
    **kwargs: object,
) -> LeaderElector:
    return LeaderElector(
        backend,
        shard=0,
        ttl=TTL,
        safety_margin=MARGIN,
        acquire_epoch=epochs,
        holder=holder,
        clock=clock,
        **kwargs,  # type: ignore[arg-type]
    )


# -- acquisition -----------------------------------------------------------------


def test_acquire_returns_a_fenced_lease(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    lease = elector.try_acquire()
    assert lease is not None
    assert lease.shard == 0
    assert lease.epoch == 1
    assert epochs.holders == ["beat-a"]
    assert backend.holder(0) == lease.token
    assert elector.is_leader()
    assert elector.current() == lease


def test_tokens_are_unique_and_name_the_holder(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs, holder="beat@host-7")
    first = elector.try_acquire()
    assert first is not None
    elector.release()
    second = elector.try_acquire()
    assert second is not None
    assert first.token != second.token
    assert "beat@host-7" in first.token
    assert "beat@host-7" in second.token
    assert second.epoch == first.epoch + 1


def test_valid_until_is_measured_from_before_the_set(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    slow = SlowBackend(backend, clock, delay=2.0)
    elector = make(slow, clock, epochs)
    t0 = clock()
    lease = elector.try_acquire()
    assert lease is not None
    # The 2 s the SET took count against the lease, not in its favour.
    assert lease.valid_until == pytest.approx(t0 + TTL - MARGIN)
    assert clock() == pytest.approx(t0 + 2.0)

    t1 = clock()
    assert elector.renew() is True
    renewed = elector.current()
    assert renewed is not None
    assert renewed.valid_until == pytest.approx(t1 + TTL - MARGIN)
    assert renewed.token == lease.token
    assert renewed.epoch == lease.epoch


def test_try_acquire_while_leading_keeps_the_same_lease(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    lease = elector.try_acquire()
    assert lease is not None
    clock.advance(3.0)
    again = elector.try_acquire()
    assert again is not None
    assert again.token == lease.token
    assert again.epoch == lease.epoch
    assert again.valid_until == pytest.approx(lease.valid_until + 3.0)
    assert epochs.epochs[0] == 1


def test_acquire_fails_quietly_when_backend_is_down(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    backend.available = False
    assert elector.try_acquire() is None
    assert not elector.is_leader()
    assert epochs.holders == []
    backend.available = True
    assert elector.try_acquire() is not None


def test_epoch_failure_releases_the_lease_and_stays_standby(
    backend: MemoryLeaseBackend,
    clock: FakeClock,
    epochs: Epochs,
    caplog: pytest.LogCaptureFixture,
) -> None:
    elector = make(backend, clock, epochs)
    epochs.down = True
    with caplog.at_level(logging.WARNING, logger="celery_sched.lease"):
        assert elector.try_acquire() is None
    assert not elector.is_leader()
    # Freed at once, not left to expire: a healthier process may lead now.
    assert backend.holder(0) is None
    assert any(
        r.levelno == logging.WARNING and "epoch bump failed" in r.getMessage()
        for r in caplog.records
    )
    other = make(backend, clock, Epochs(), holder="beat-b")
    assert other.try_acquire() is not None

    other.release()
    epochs.down = False
    lease = elector.try_acquire()
    assert lease is not None
    assert lease.epoch == 1


def test_any_epoch_error_is_contained(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    def broken(shard: int, holder: str) -> int:
        raise RuntimeError("boom")

    elector = LeaderElector(
        backend,
        shard=0,
        ttl=TTL,
        safety_margin=MARGIN,
        acquire_epoch=broken,
        holder="beat-a",
        clock=clock,
    )
    assert elector.try_acquire() is None
    assert backend.holder(0) is None


# -- local validity ---------------------------------------------------------------


def test_leader_stops_trusting_the_lease_at_valid_until(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    lease = elector.try_acquire()
    assert lease is not None
    clock.now = lease.valid_until - 0.001
    assert elector.is_leader()
    clock.now = lease.valid_until
    # No renewal failed, Redis still holds our token; the deadline alone decides.
    assert backend.holder(0) == lease.token
    assert not elector.is_leader()
    assert elector.current() is None
    # The key had not expired, so nobody else could have led: a renewal may
    # legitimately restore the lease.
    assert elector.renew() is True
    assert elector.is_leader()


def test_valid_until_falls_before_the_backend_expiry(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    a = make(backend, clock, epochs, holder="beat-a")
    b = make(backend, clock, epochs, holder="beat-b")
    lease = a.try_acquire()
    assert lease is not None
    # Walk time forward in small steps: at no instant may both be leaders.
    for _ in range(200):
        clock.advance(0.05)
        b.try_acquire()
        assert not (a.is_leader() and b.is_leader())
    assert b.is_leader()
    assert not a.is_leader()


# -- renewal -------------------------------------------------------------------------


def test_failed_renewal_steps_down(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    lost: list[Lease] = []
    elector = make(backend, clock, epochs, on_lost=lost.append)
    lease = elector.try_acquire()
    assert lease is not None
    elector.wait_changed(0)
    clock.advance(TTL + 1)
    other = make(backend, clock, epochs, holder="beat-b")
    assert other.try_acquire() is not None

    assert elector.renew() is False
    assert not elector.is_leader()
    assert elector.current() is None
    assert lost == [lease]
    assert elector.wait_changed(0) is True
    # The successor's lease is untouched.
    other_lease = other.current()
    assert other_lease is not None
    assert backend.holder(0) == other_lease.token


def test_unreachable_backend_during_renewal_steps_down(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    lost: list[Lease] = []
    elector = make(backend, clock, epochs, on_lost=lost.append)
    lease = elector.try_acquire()
    assert lease is not None
    clock.advance(1.0)
    backend.available = False
    assert elector.renew() is False
    assert not elector.is_leader()
    assert lost == [lease]


def test_renew_without_a_lease_is_false(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    assert elector.renew() is False
    assert elector.wait_changed(0) is False


# -- release and notifications ---------------------------------------------------------


def test_release_frees_the_lease_for_others(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elected: list[Lease] = []
    lost: list[Lease] = []
    a = make(backend, clock, epochs, on_elected=elected.append, on_lost=lost.append)
    lease = a.try_acquire()
    assert lease is not None
    assert elected == [lease]
    a.release()
    assert not a.is_leader()
    assert lost == [lease]
    assert backend.holder(0) is None
    b = make(backend, clock, epochs, holder="beat-b")
    other = b.try_acquire()
    assert other is not None
    assert other.epoch == lease.epoch + 1
    a.release()  # nothing held: a no-op, no second notification
    assert lost == [lease]


def test_release_survives_an_unreachable_backend(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    assert elector.try_acquire() is not None
    backend.available = False
    elector.release()
    assert not elector.is_leader()


def test_wait_changed_reports_each_role_change(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    assert elector.wait_changed(0) is False
    elector.try_acquire()
    assert elector.wait_changed(0) is True
    assert elector.wait_changed(0) is False
    assert elector.renew() is True  # staying leader is not a change
    assert elector.wait_changed(0) is False
    elector.release()
    assert elector.wait_changed(0) is True


def test_a_failing_callback_does_not_break_the_elector(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    def explode(lease: Lease) -> None:
        raise RuntimeError("callback bug")

    elector = make(backend, clock, epochs, on_elected=explode)
    assert elector.try_acquire() is not None
    assert elector.is_leader()


# -- two electors ------------------------------------------------------------------------


def test_two_electors_exactly_one_leader(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    a = make(backend, clock, epochs, holder="beat-a")
    b = make(backend, clock, epochs, holder="beat-b")
    first = a.try_acquire()
    assert first is not None
    assert b.try_acquire() is None
    assert a.is_leader() and not b.is_leader()

    # A keeps renewing: B never gets in.
    for _ in range(10):
        clock.advance(TTL / 3)
        assert a.renew() is True
        assert b.try_acquire() is None
        assert a.is_leader() and not b.is_leader()

    # A goes silent; once its lease expired in the backend B takes over.
    clock.advance(TTL - 0.01)
    assert b.try_acquire() is None
    assert not a.is_leader()  # A already distrusts its lease
    clock.advance(0.02)
    second = b.try_acquire()
    assert second is not None
    assert second.epoch > first.epoch
    assert b.is_leader() and not a.is_leader()
    assert a.renew() is False


def test_invalid_configuration_is_refused(backend: MemoryLeaseBackend, epochs: Epochs) -> None:
    with pytest.raises(ValueError, match="safety_margin"):
        LeaderElector(
            backend, shard=0, ttl=1.0, safety_margin=1.0, acquire_epoch=epochs, holder="x"
        )
    with pytest.raises(ValueError, match="ttl"):
        LeaderElector(
            backend, shard=0, ttl=0.0, safety_margin=0.0, acquire_epoch=epochs, holder="x"
        )


# -- the background thread (real time) ------------------------------------------------------

REAL_TTL = 0.3
REAL_MARGIN = 0.05


def real_elector(
    backend: LeaseBackend, epochs: Epochs, holder: str, **kwargs: object
) -> LeaderElector:
    return LeaderElector(
        backend,
        shard=0,
        ttl=REAL_TTL,
        safety_margin=REAL_MARGIN,
        acquire_epoch=epochs,
        holder=holder,
        **kwargs,  # type: ignore[arg-type]
    )


def wait_for(predicate: object, timeout: float) -> bool:
    assert callable(predicate)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def test_thread_keeps_the_lease_and_a_standby_takes_over_after_a_kill(epochs: Epochs) -> None:
    backend = MemoryLeaseBackend()
    a = real_elector(backend, epochs, "beat-a")
    b = real_elector(backend, epochs, "beat-b")
    a.start()
    try:
        assert wait_for(a.is_leader, 1.0)
        first = a.current()
        assert first is not None
        b.start()
        # Several ttls: A renews on its own, B never gets in, never two leaders.
        end = time.monotonic() + 4 * REAL_TTL
        while time.monotonic() < end:
            assert a.is_leader()
            assert not b.is_leader()
            assert backend.holder(0) == first.token
            time.sleep(0.01)

        # Kill A: its thread stops, its lease is left to expire.
        a.stop(release=False)
        killed_at = time.monotonic()
        while not b.is_leader():
            assert not a.is_leader() or not b.is_leader()
            assert time.monotonic() - killed_at < 2.0, "no takeover"
            time.sleep(0.002)
        took = time.monotonic() - killed_at
        # Expiry (ttl) plus at most one standby interval (ttl/3); a little
        # slack for thread scheduling on a loaded machine.
        assert took <= REAL_TTL + REAL_TTL / 3 + 0.15
        second = b.current()
        assert second is not None
        assert second.epoch > first.epoch
        assert not a.is_leader()
    finally:
        a.stop()
        b.stop()
    assert backend.holder(0) is None


def test_stop_releases_and_signals(epochs: Epochs) -> None:
    backend = MemoryLeaseBackend()
    changes = threading.Event()
    a = real_elector(backend, epochs, "beat-a", on_elected=lambda lease: changes.set())
    a.start()
    a.start()  # idempotent
    assert a.wait_changed(1.0)
    assert changes.is_set()
    assert a.is_leader()
    a.stop()
    assert not a.is_leader()
    assert backend.holder(0) is None
    assert a.wait_changed(0) is True  # the loss


class FlakyBackend(LeaseBackend):
    """Raises an unexpected error on the first few calls of each kind."""

    def __init__(self, inner: LeaseBackend, failures: int) -> None:
        self.inner = inner
        self.failures = {"acquire": failures, "renew": failures}

    def _maybe_fail(self, what: str) -> None:
        if self.failures[what] > 0:
            self.failures[what] -= 1
            raise RuntimeError(f"unexpected {what} failure")

    def acquire(self, shard: int, token: str, ttl: float) -> bool:
        self._maybe_fail("acquire")
        return self.inner.acquire(shard, token, ttl)

    def renew(self, shard: int, token: str, ttl: float) -> bool:
        self._maybe_fail("renew")
        return self.inner.renew(shard, token, ttl)

    def release(self, shard: int, token: str) -> bool:
        return self.inner.release(shard, token)

    def holder(self, shard: int) -> str | None:
        return self.inner.holder(shard)


def test_thread_survives_unexpected_backend_errors(
    epochs: Epochs, caplog: pytest.LogCaptureFixture
) -> None:
    backend = MemoryLeaseBackend()
    flaky = FlakyBackend(backend, failures=2)
    a = real_elector(flaky, epochs, "beat-a")
    with caplog.at_level(logging.ERROR, logger="celery_sched.lease"):
        a.start()
        try:
            assert wait_for(a.is_leader, 4 * REAL_TTL)
            # A renewal that blows up drops the lease; the thread wins it back.
            assert wait_for(lambda: flaky.failures["renew"] == 0, 3.0)
            assert wait_for(a.is_leader, 4 * REAL_TTL)
            thread = a._thread
            assert thread is not None and thread.is_alive()
        finally:
            a.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert any("unexpected error acquiring" in m for m in messages)
    assert any("unexpected error renewing" in m for m in messages)
    assert backend.holder(0) is None


def test_thread_survives_anything(epochs: Epochs, caplog: pytest.LogCaptureFixture) -> None:
    calls = 0

    def sometimes_broken_clock() -> float:
        nonlocal calls
        calls += 1
        if calls in (1, 2, 5):
            raise RuntimeError("clock trouble")
        return time.monotonic()

    backend = MemoryLeaseBackend()
    a = real_elector(backend, epochs, "beat-a", clock=sometimes_broken_clock)
    with caplog.at_level(logging.ERROR, logger="celery_sched.lease"):
        a.start()
        try:
            assert wait_for(lambda: calls > 5 and a.is_leader(), 3.0)
            thread = a._thread
            assert thread is not None and thread.is_alive()
        finally:
            a.stop()
    assert any("unexpected error in the lease thread" in r.getMessage() for r in caplog.records)


def test_standby_frees_an_orphaned_lease_after_a_backend_blip(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    lease = elector.try_acquire()
    assert lease is not None
    backend.available = False
    assert elector.renew() is False
    backend.available = True
    # The old key is still there; without freeing it we would wait a ttl.
    assert backend.holder(0) == lease.token
    again = elector.try_acquire()
    assert again is not None
    assert again.token != lease.token
    assert again.epoch == lease.epoch + 1


def test_release_also_frees_an_orphaned_lease(
    backend: MemoryLeaseBackend, clock: FakeClock, epochs: Epochs
) -> None:
    elector = make(backend, clock, epochs)
    lease = elector.try_acquire()
    assert lease is not None
    backend.available = False
    assert elector.renew() is False
    backend.available = True
    assert backend.holder(0) == lease.token
    # Shutting down right after the blip must not leave the key to expire.
    elector.stop()
    assert backend.holder(0) is None


def test_a_standby_tries_at_its_own_pace_and_wins_soon_after_the_lease_frees() -> None:
    backend = MemoryLeaseBackend()
    assert backend.acquire(0, "other:1:x", 0.6)
    paced = functools.partial(
        LeaderElector,
        backend,
        shard=0,
        ttl=6.0,
        safety_margin=0.5,
        acquire_epoch=lambda shard, holder: 1,
        holder="me:2",
    )
    elector = paced(standby_interval=0.1)
    assert (elector.interval, elector.standby_interval) == (2.0, 0.1)
    started = time.monotonic()
    elector.start()
    try:
        assert elector.wait_changed(timeout=3.0)
        # The other lease ran out at 0.6 s; with the default pace (ttl / 3 =
        # 2 s) the next attempt would come at 2 s.
        assert time.monotonic() - started < 1.2
        assert elector.is_leader()
    finally:
        elector.stop()
    with pytest.raises(ValueError, match="standby_interval"):
        paced(standby_interval=0.0)
