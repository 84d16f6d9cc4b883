"""The leader loop on in-memory fakes with a controlled clock."""

from __future__ import annotations

import dataclasses
import datetime as dt
import itertools
import threading
import time
import uuid
from collections.abc import Iterable
from typing import Any

import pytest

from celery_sched.dispatch.memory import MemoryDispatcher
from celery_sched.errors import StagingUnavailable, StoreUnavailable
from celery_sched.leader import Engine, sweeping
from celery_sched.lease.elector import LeaderElector
from celery_sched.lease.memory import MemoryLeaseBackend
from celery_sched.models import Job, JobStatus, WorkerUpdate
from celery_sched.settings import Settings
from celery_sched.staging.memory import MemoryStaging
from celery_sched.store.memory import MemoryJobStore
from tests.contract.conftest import new_job

START = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


class Clock:
    """One clock for the store (wall time) and the lease (monotonic)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def wall(self) -> dt.datetime:
        return START + dt.timedelta(seconds=self.offset)

    def mono(self) -> float:
        return 1000.0 + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


class FlakyStaging(MemoryStaging):
    """Staging whose Redis can be switched off."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise StagingUnavailable("redis is down (test)")

    def add(self, shard: int, items: Iterable[tuple[uuid.UUID, dt.datetime]]) -> int:
        self._check()
        return super().add(shard, items)

    def pop_due(self, *args: Any, **kwargs: Any) -> list[uuid.UUID]:
        self._check()
        return super().pop_due(*args, **kwargs)

    def next_due(self, shard: int) -> dt.datetime | None:
        self._check()
        return super().next_due(shard)


class FlakyStore(MemoryJobStore):
    """A memory store whose database can be switched off."""

    down = False

    def claim_due(self, **kwargs: Any) -> Any:
        if self.down:
            raise StoreUnavailable("postgres is down (test)")
        return super().claim_due(**kwargs)

    def now(self) -> dt.datetime:
        if self.down:
            raise StoreUnavailable("postgres is down (test)")
        return super().now()


@dataclasses.dataclass
class Rig:
    clock: Clock
    store: FlakyStore
    staging: FlakyStaging
    dispatcher: MemoryDispatcher
    lease: MemoryLeaseBackend
    settings: Settings
    _counter: Any = dataclasses.field(default_factory=itertools.count)

    def elector(self, holder: str) -> LeaderElector:
        return LeaderElector(
            self.lease,
            shard=0,
            ttl=self.settings.lease_ttl,
            safety_margin=self.settings.lease_safety_margin,
            acquire_epoch=self.store.acquire_epoch,
            holder=holder,
            clock=self.clock.mono,
        )

    def engine(self, elector: LeaderElector, dispatcher: MemoryDispatcher | None = None) -> Engine:
        return Engine(
            store=self.store,
            staging=self.staging,
            dispatcher=dispatcher or self.dispatcher,
            elector=elector,
            settings=self.settings,
            clock=self.clock.mono,
            wall=self.clock.wall,
        )

    def add(self, seconds_from_now: float, **fields: Any) -> uuid.UUID:
        job = new_job(
            f"job-{next(self._counter)}",
            self.clock.wall() + dt.timedelta(seconds=seconds_from_now),
            **fields,
        )
        self.store.add_job(job)
        return job.id

    def run(self, engine: Engine, seconds: float, step: float = 0.1) -> None:
        """Drive ``engine`` for ``seconds`` of fake time, renewing its lease
        every ttl/3 as the elector's thread would."""
        end = self.clock.offset + seconds
        next_renewal = self.clock.offset
        while self.clock.offset < end:
            if self.clock.offset >= next_renewal:
                if engine.elector.current() is not None:
                    engine.elector.renew()
                else:
                    engine.elector.try_acquire()
                next_renewal = self.clock.offset + self.settings.lease_ttl / 3
            delay = engine.step()
            self.clock.advance(max(step, min(delay, step)))

    def status(self, job_id: uuid.UUID) -> JobStatus:
        job = self.store.get_by_id(job_id)
        assert job is not None
        return job.status


@pytest.fixture
def rig() -> Rig:
    clock = Clock()
    settings = Settings(
        lease_ttl=3.0,
        lease_safety_margin=0.3,
        visibility_timeout=20.0,
        sweep_interval=2.0,
        reconcile_interval=1.0,
        staging_window=30.0,
        batch_size=50,
    )
    store = FlakyStore(clock=clock.wall)
    # A tracked deployment: a worker beats (no task list: it tracks every
    # task), so the reconciler requeues what was dispatched and not started.
    store.heartbeat("worker@test", 4242)
    return Rig(
        clock=clock,
        store=store,
        staging=FlakyStaging(),
        dispatcher=MemoryDispatcher(),
        lease=MemoryLeaseBackend(clock=clock.mono),
        settings=settings,
    )


def test_standby_dispatches_nothing(rig: Rig) -> None:
    rig.add(-1)
    engine = rig.engine(rig.elector("b"))
    delay = engine.step()
    assert engine.role == "standby"
    assert rig.dispatcher.sent_ids() == []
    assert 0 < delay <= rig.settings.lease_ttl / 3


def test_leader_publishes_due_jobs_once_and_future_jobs_when_due(rig: Rig) -> None:
    overdue = rig.add(-5)
    soon = rig.add(4.0)
    later = rig.add(300)
    elector = rig.elector("a")
    assert elector.try_acquire() is not None
    engine = rig.engine(elector)

    engine.step()
    assert rig.dispatcher.sent_ids() == [overdue]
    assert rig.staging.size(0) == 1  # `soon` is within the window; `later` is not

    # The loop asks to sleep until `soon` is due (or less), not a fixed tick.
    delay = engine.step()
    assert delay <= 1.0

    elector_renew_every = rig.settings.lease_ttl / 3
    for _ in range(int(5 / 0.1)):
        engine.step()
        rig.clock.advance(0.1)
        if round(rig.clock.offset, 1) % elector_renew_every < 0.1:
            elector.renew()
    assert rig.dispatcher.sent_ids() == [overdue, soon]
    message = rig.dispatcher.messages[1]
    assert message.headers["celery_sched_epoch"] == engine.epoch
    assert rig.status(later) == JobStatus.PENDING
    assert rig.status(soon) == JobStatus.DISPATCHED


def test_a_job_is_never_published_before_its_due_time(rig: Rig) -> None:
    job_id = rig.add(2.05)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    while rig.clock.offset < 2.0:
        engine.step()
        assert job_id not in rig.dispatcher.sent_ids()
        rig.clock.advance(0.01)
    rig.clock.advance(0.1)
    engine.step()
    assert rig.dispatcher.sent_ids() == [job_id]


def test_publish_failure_releases_jobs_and_they_are_sent_later(rig: Rig) -> None:
    ids = [rig.add(-1) for _ in range(3)]
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    rig.dispatcher.set_down(True)
    engine.step()
    assert rig.dispatcher.sent_ids() == []
    assert {rig.status(i) for i in ids} == {JobStatus.PENDING}
    assert engine.stats.released == 3

    rig.dispatcher.set_down(False)
    rig.run(engine, rig.settings.sweep_interval + 0.5)
    assert sorted(rig.dispatcher.sent_ids()) == sorted(ids)


def test_expired_jobs_are_not_sent_and_say_why(rig: Rig) -> None:
    expired = rig.add(-10, expires_at=rig.clock.wall() - dt.timedelta(seconds=1))
    fresh = rig.add(-10, expires_at=rig.clock.wall() + dt.timedelta(seconds=60))
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    assert rig.dispatcher.sent_ids() == [fresh]
    job = rig.store.get_by_id(expired)
    assert job is not None and job.status == JobStatus.EXPIRED
    assert job.last_error and "expired" in job.last_error


def test_stale_leader_is_fenced_steps_down_and_claims_nothing(rig: Rig) -> None:
    old = rig.elector("old")
    old.try_acquire()
    old_engine = rig.engine(old)
    old_engine.step()
    assert old_engine.role == "leader"

    # The old leader is paused past its TTL; another process takes over.
    rig.clock.advance(rig.settings.lease_ttl + 0.1)
    new = rig.elector("new")
    lease = new.try_acquire()
    assert lease is not None and lease.epoch > (old_engine.epoch or 0)
    job_id = rig.add(-1)

    old_engine.step()  # wakes up: its lease is past the local deadline
    assert old_engine.role == "standby"
    assert rig.dispatcher.sent_ids() == []
    # Even a claim that slipped past the local check is refused by the fence.
    from celery_sched.errors import StaleEpoch

    with pytest.raises(StaleEpoch):
        rig.store.claim_due(shard=0, epoch=lease.epoch - 1, limit=10)

    new_engine = rig.engine(new)
    new_engine.step()
    assert rig.dispatcher.sent_ids() == [job_id]


def test_engine_steps_down_when_the_store_reports_a_stale_epoch(rig: Rig) -> None:
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    # Someone bumps the epoch behind this leader's back (a split brain the
    # lease alone would not catch): the next claim is refused.
    rig.store.acquire_epoch(0, "intruder")
    rig.add(-1)
    rig.clock.advance(rig.settings.sweep_interval)
    assert engine.step() == 0.0
    assert engine.role == "standby"
    assert rig.dispatcher.sent_ids() == []
    assert elector.current() is None


def test_redis_outage_falls_back_to_the_postgres_sweep(rig: Rig) -> None:
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    rig.staging.down = True
    ids = [rig.add(1.0 + i * 0.5) for i in range(4)]
    rig.run(engine, 2.0 + rig.settings.sweep_interval + 1.5)
    assert sorted(rig.dispatcher.sent_ids()) == sorted(ids)


def test_staging_wiped_mid_run_loses_nothing(rig: Rig) -> None:
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    ids = [rig.add(1.0 + i * 0.2) for i in range(10)]
    engine.step()
    assert rig.staging.size(0) == 10
    rig.staging.clear()  # FLUSHALL
    rig.run(engine, 2.0 + rig.settings.sweep_interval + 0.5)
    assert sorted(rig.dispatcher.sent_ids()) == sorted(ids)


def test_store_outage_backs_off_without_crashing_and_recovers(rig: Rig) -> None:
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    job_id = rig.add(-1)
    rig.store.down = True
    rig.clock.advance(rig.settings.sweep_interval)
    delays = []
    for _ in range(4):
        delays.append(engine.step())
        rig.clock.advance(0.1)
    assert delays == sorted(delays) and delays[0] > 0
    assert engine.stats.errors >= 4
    rig.store.down = False
    rig.clock.advance(max(delays))
    elector.renew()
    rig.run(engine, rig.settings.sweep_interval + 0.5)
    assert rig.dispatcher.sent_ids() == [job_id]


def test_reconciler_requeues_jobs_that_no_worker_took(rig: Rig) -> None:
    job_id = rig.add(-1)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    assert rig.dispatcher.sent_ids() == [job_id]
    # No worker marked it running: past the visibility timeout it goes again.
    for _ in range(int((rig.settings.visibility_timeout + rig.settings.sweep_interval + 2) / 0.5)):
        engine.step()
        rig.clock.advance(0.5)
        elector.renew()
    assert rig.dispatcher.sent_ids() == [job_id, job_id]
    job = rig.store.get_by_id(job_id)
    assert job is not None and job.attempt == 1


def test_a_job_no_worker_tracks_is_sent_once_and_ends_sent(rig: Rig) -> None:
    # #15 (1): workers without tracking (no heartbeat lists the task) report
    # nothing, so the reconciler does not send the job again.
    assert rig.store.prune_workers(older_than=-1) == 1  # no worker beats
    job_id = rig.add(-1)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    for _ in range(int((rig.settings.visibility_timeout + rig.settings.sweep_interval + 2) / 0.5)):
        engine.step()
        rig.clock.advance(0.5)
        elector.renew()
    assert rig.dispatcher.sent_ids() == [job_id]
    assert rig.status(job_id) is JobStatus.SENT
    assert engine.stats.untracked == 1 and engine.stats.requeued == 0


def test_a_started_job_is_not_requeued(rig: Rig) -> None:
    job_id = rig.add(-1)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    rig.store.mark_running(job_id, worker="w1")
    for _ in range(int((rig.settings.visibility_timeout + 5) / 0.5)):
        engine.step()
        rig.clock.advance(0.5)
        elector.renew()
    assert rig.dispatcher.sent_ids() == [job_id]


def test_a_retry_whose_message_was_lost_is_sent_again_after_its_eta_and_the_timeout(
    rig: Rig,
) -> None:
    # Issue 13 (12), seen in the chaos soak: a worker reported the job
    # retrying in 10 s, then the broker restarted empty and the retry
    # message was gone; the job stayed retrying for ever.
    job_id = rig.add(-1)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    assert rig.dispatcher.sent_ids() == [job_id]
    rig.store.apply_worker_updates(
        [
            WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w1", attempt=0),
            WorkerUpdate(job_id=job_id, status=JobStatus.RETRYING, error="held", retry_in=10),
        ]
    )
    # A retry is given its ETA plus the visibility timeout to start ...
    rig.run(engine, 10 + rig.settings.visibility_timeout - 1)
    assert rig.dispatcher.sent_ids() == [job_id]
    assert rig.status(job_id) == JobStatus.RETRYING
    # ... and is then sent again as the next attempt.
    rig.run(engine, 1 + rig.settings.reconcile_interval + rig.settings.sweep_interval + 1)
    assert rig.dispatcher.sent_ids() == [job_id, job_id]
    assert rig.dispatcher.messages[-1].headers["celery_sched_attempt"] == 1
    job = rig.store.get_by_id(job_id)
    assert job is not None
    assert (job.status, job.attempt) == (JobStatus.DISPATCHED, 1)


def test_backlog_is_drained_in_batches_without_sleeping(rig: Rig) -> None:
    ids = [rig.add(-1) for _ in range(rig.settings.batch_size * 3 + 7)]
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    assert sorted(rig.dispatcher.sent_ids()) == sorted(ids)
    assert len(set(rig.dispatcher.sent_ids())) == len(ids)


def test_staged_copies_of_a_swept_backlog_are_dropped_not_claimed_again(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Client.schedule_many stages jobs due within the window, so a backlog
    # due now is both in the store and in the staging set.
    batch = rig.settings.batch_size
    ids = [rig.add(-30 + i * 0.01) for i in range(batch * 8)]
    due = {job_id: rig.store.get_by_id(job_id).due_at for job_id in ids}  # type: ignore[union-attr]
    rig.staging.add(0, due.items())
    asked: list[uuid.UUID] = []
    real_claim_ids = rig.store.claim_ids

    def claim_ids(job_ids: Any, **kwargs: Any) -> list[Job]:
        job_ids = list(job_ids)
        asked.extend(i for i in job_ids if rig.status(i) is not JobStatus.PENDING)
        return real_claim_ids(job_ids, **kwargs)

    monkeypatch.setattr(rig.store, "claim_ids", claim_ids)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    for _ in range(10):
        engine.step()
    assert sorted(rig.dispatcher.sent_ids()) == sorted(ids)
    assert len(set(rig.dispatcher.sent_ids())) == len(ids)
    assert rig.staging.size(0) == 0
    # The first pop claims a batch, the sweep the other seven. Without the
    # drop every staged copy of those seven would be popped and found taken;
    # with it, only the batch claimed ahead of the mid-sweep pop and the
    # copies staged past that pop's drop are.
    assert len(asked) <= 3 * batch


def test_a_job_whose_staged_copy_the_sweep_drops_runs_by_the_next_sweep(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop's race: a job committed after the sweep's last claim looked,
    due before the sweep's cursor, loses its staged copy. It is still
    pending in the store, so the next sweep sends it, once."""
    batch = rig.settings.batch_size
    backlog = [rig.add(-30 + i * 0.01) for i in range(batch * 4 + 10)]
    claims: list[int] = []
    last_claim_done = threading.Event()
    real_claim_due = rig.store.claim_due

    def claim_due(**kwargs: Any) -> list[Job]:
        jobs = real_claim_due(**kwargs)
        claims.append(len(jobs))
        # Four full batches, then the claims in flight when the fourth is
        # published (the mid-sweep pop's turn): the partial batch and what
        # follows it, which end the sweep.
        if len(claims) == 4 + sweeping.CLAIMS_AHEAD:
            last_claim_done.set()
        return jobs

    late: list[uuid.UUID] = []
    real_pop = rig.staging.pop_due

    def pop_due(*args: Any, **kwargs: Any) -> list[uuid.UUID]:
        if kwargs.get("drop_through") is not None and not late:
            assert last_claim_done.wait(5)
            # Committed and staged just after the last claim's snapshot.
            late.append(rig.add(-60))
            job = rig.store.get_by_id(late[0])
            assert job is not None
            rig.staging.add(0, [(job.id, job.due_at)])
        return real_pop(*args, **kwargs)

    monkeypatch.setattr(rig.store, "claim_due", claim_due)
    monkeypatch.setattr(rig.staging, "pop_due", pop_due)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    assert late, "the mid-sweep pop never ran"
    assert sorted(rig.dispatcher.sent_ids()) == sorted(backlog)
    assert rig.status(late[0]) == JobStatus.PENDING
    assert rig.staging.size(0) == 0  # its staged copy was dropped
    rig.run(engine, rig.settings.sweep_interval + 1.0)
    assert rig.dispatcher.sent_ids().count(late[0]) == 1
    assert sorted(rig.dispatcher.sent_ids()) == sorted([*backlog, late[0]])


@pytest.mark.parametrize(
    ("pool_max_size", "most"), [(8, sweeping.CLAIMS_AHEAD), (2, 1)], ids=["pool8", "pool2"]
)
def test_claims_in_flight_are_bounded_and_take_disjoint_rows(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, pool_max_size: int, most: int
) -> None:
    rig.settings = dataclasses.replace(rig.settings, pool_max_size=pool_max_size)
    batch = rig.settings.batch_size
    ids = [rig.add(-30 + i * 0.001) for i in range(batch * 8)]
    in_flight = 0
    peak = 0
    lock = threading.Lock()
    real_claim_due = rig.store.claim_due

    def claim_due(**kwargs: Any) -> list[Job]:
        nonlocal in_flight, peak
        with lock:
            in_flight += 1
            peak = max(peak, in_flight)
        try:
            time.sleep(0.02)  # long enough for the sweep to start the others
            return real_claim_due(**kwargs)
        finally:
            with lock:
                in_flight -= 1

    monkeypatch.setattr(rig.store, "claim_due", claim_due)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    engine.step()
    sent = rig.dispatcher.sent_ids()
    assert sorted(sent) == sorted(ids) and len(set(sent)) == len(sent)
    assert peak == most


def test_a_batch_claimed_ahead_is_released_when_publishing_fails(rig: Rig) -> None:
    ids = [rig.add(-1) for _ in range(rig.settings.batch_size * (sweeping.CLAIMS_AHEAD + 2))]
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    rig.dispatcher.set_down(True)
    engine.step()
    # The failing batch and every batch claimed ahead of it went back.
    assert {rig.status(i) for i in ids} == {JobStatus.PENDING}
    rig.dispatcher.set_down(False)
    rig.run(engine, rig.settings.sweep_interval + 1)
    assert sorted(rig.dispatcher.sent_ids()) == sorted(ids)


def test_the_leader_prunes_old_jobs_and_ledger_entries_a_batch_at_a_time(rig: Rig) -> None:
    from celery_sched.leader.housekeeping import HOUSEKEEPING_INTERVAL
    from celery_sched.store.memory import MemoryLedger

    rig.settings = dataclasses.replace(
        rig.settings, retention=60.0, ledger_retention=60.0, prune_batch=2
    )
    finished = [rig.add(-1) for _ in range(3)]
    kept = rig.add(3600)
    for job_id in finished:
        assert rig.store.mark_finished(job_id, JobStatus.SUCCEEDED)
    ledger = MemoryLedger(clock=rig.clock.wall)
    for key in ("a", "b", "c"):
        ledger.acquire(key, owner="w", lease=30)
        assert ledger.complete(key, owner="w")
    ledger.acquire("running", owner="w", lease=3600)
    rig.clock.advance(61)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = Engine(
        store=rig.store,
        staging=rig.staging,
        dispatcher=rig.dispatcher,
        elector=elector,
        settings=rig.settings,
        clock=rig.clock.mono,
        wall=rig.clock.wall,
        ledger=ledger,
    )
    engine.step()
    # One bounded batch per table per round, never the whole backlog at once.
    assert (engine.stats.pruned_jobs, engine.stats.pruned_ledger) == (2, 2)
    engine.step()
    assert (engine.stats.pruned_jobs, engine.stats.pruned_ledger) == (2, 2)
    rig.run(engine, HOUSEKEEPING_INTERVAL + 1)
    assert (engine.stats.pruned_jobs, engine.stats.pruned_ledger) == (3, 3)
    assert all(rig.store.get_by_id(job_id) is None for job_id in finished)
    assert rig.store.get_by_id(kept) is not None
    assert ledger.get("running") is not None and ledger.get("a") is None


# -- hardening (issue 13) ----------------------------------------------------------


def leading_engine(rig: Rig, dispatcher: MemoryDispatcher | None = None) -> Engine:
    elector = rig.elector("a")
    assert elector.try_acquire() is not None
    return rig.engine(elector, dispatcher)


def test_a_job_that_cannot_be_published_fails_alone_and_ends_dead(rig: Rig) -> None:
    """Defect 1: an unpublishable job counts an attempt per failure and ends
    dead; it is not released as it was (attempt unchanged, claimed first in
    every sweep, forever), and its batch goes out."""
    good = [rig.add(-1) for _ in range(5)]
    bad = rig.add(-2, max_attempts=3)
    rig.dispatcher.reject(bad, "queue 'nowhere' is not in task_queues")
    engine = leading_engine(rig)
    delay = engine.step()
    assert sorted(rig.dispatcher.sent_ids()) == sorted(good)
    job = rig.store.get_by_id(bad)
    assert job is not None
    assert (job.status, job.attempt) == (JobStatus.PENDING, 1)
    assert job.last_error is not None and "nowhere" in job.last_error
    assert engine.stats.released == 0 and engine.stats.rejected == 1
    assert delay > 0  # not a hot loop: no broker failure, nothing more due
    rig.run(engine, 3 * rig.settings.sweep_interval + 1)
    job = rig.store.get_by_id(bad)
    assert job is not None
    assert (job.status, job.attempt) == (JobStatus.DEAD, 3)
    assert job.finished_at is not None
    assert job.last_error is not None and "giving up" in job.last_error
    assert engine.stats.dead == 1
    assert bad not in rig.dispatcher.sent_ids()
    assert sorted(rig.dispatcher.sent_ids()) == sorted(good)  # each once


def test_the_reconciler_and_pruning_run_while_every_publish_fails(rig: Rig) -> None:
    """Defect 1: a pass whose publish fails used to raise before reconciling,
    so a job the broker had lost was not requeued while the outage lasted."""
    lost = rig.add(-1)
    engine = leading_engine(rig)
    engine.step()
    assert rig.dispatcher.sent_ids() == [lost]  # ...and the broker loses it
    rig.dispatcher.set_down(True)
    blocked = rig.add(-1)  # keeps every pass publishing, and failing
    rig.run(engine, rig.settings.visibility_timeout + 2 * rig.settings.reconcile_interval)
    job = rig.store.get_by_id(lost)
    assert job is not None and job.attempt == 1
    assert engine.stats.requeued >= 1
    assert engine.stats.failures.get("sweep", 0) + engine.stats.failures.get("pop", 0) > 0
    assert rig.status(blocked) == JobStatus.PENDING  # released, attempt kept
    assert rig.store.get_by_id(blocked).attempt == 0  # type: ignore[union-attr]
    rig.dispatcher.set_down(False)
    rig.run(engine, rig.settings.sweep_interval + 1)
    assert sorted(set(rig.dispatcher.sent_ids())) == sorted([lost, blocked])


def test_a_broker_outage_backs_the_loop_off(rig: Rig) -> None:
    rig.add(-1)
    engine = leading_engine(rig)
    rig.dispatcher.set_down(True)
    delays = []
    for _ in range(4):
        delays.append(engine.step())
        rig.clock.advance(rig.settings.sweep_interval)
        engine.elector.renew()
    assert delays == sorted(delays) and delays[0] >= 0.25 and delays[-1] > delays[0]


@pytest.mark.parametrize(
    "error", [OverflowError("date value out of range"), KeyError("x"), TypeError("bad row")]
)
def test_any_exception_in_a_duty_is_survived_and_the_others_still_run(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    """Defect 6: only CelerySchedError was caught; anything else ended beat."""
    lost = rig.add(-1)
    engine = leading_engine(rig)
    engine.step()
    real_claim_due = rig.store.claim_due

    def broken_claim_due(**kwargs: Any) -> list[Job]:
        raise error

    monkeypatch.setattr(rig.store, "claim_due", broken_claim_due)
    rig.add(-1)
    with caplog.at_level("ERROR"):
        rig.run(engine, rig.settings.visibility_timeout + 2 * rig.settings.reconcile_interval)
    assert engine.stats.failures["sweep"] >= 1
    assert any(r.exc_info and r.exc_info[1] is error for r in caplog.records)
    # The reconciler ran although every sweep failed.
    assert rig.store.get_by_id(lost).attempt == 1  # type: ignore[union-attr]
    monkeypatch.setattr(rig.store, "claim_due", real_claim_due)
    rig.run(engine, rig.settings.sweep_interval + 6)
    assert len(set(rig.dispatcher.sent_ids())) == 2


def test_step_never_raises_even_outside_a_duty(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = leading_engine(rig)

    def broken_current() -> Any:
        raise RuntimeError("a bug in the loop itself")

    monkeypatch.setattr(engine.elector, "current", broken_current)
    delays = [engine.step() for _ in range(3)]
    assert all(d > 0 for d in delays) and engine.stats.failures["pass"] == 3

    def interrupted() -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.elector, "current", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()


def test_beat_tick_survives_an_exception_from_the_engine() -> None:
    from celery import Celery

    from celery_sched.beat import ERROR_DELAY, Scheduler

    class Broken:
        def step(self) -> float:
            raise ValueError("boom")

        def stop(self) -> None:
            pass

    app = Celery("tick_test", set_as_current=False)
    scheduler = Scheduler(app, lazy=True)
    scheduler._engine = Broken()
    assert scheduler.tick() == ERROR_DELAY
    assert scheduler.tick() == ERROR_DELAY


def test_a_leader_whose_lease_runs_out_mid_batch_publishes_no_further_chunk(rig: Rig) -> None:
    """Defect 4: the lease is checked before every chunk. The jobs not yet
    sent are released at once (fenced by the claim's epoch), so a successor
    sends them without waiting for the reconciler; only the sent ones'
    claim is recorded as published."""
    ids = [rig.add(-1) for _ in range(rig.settings.batch_size)]
    dispatcher = MemoryDispatcher(chunk=10)
    # Each chunk takes a second (a slow broker, a pause); the lease is
    # locally valid for ttl - margin = 2.7 s after it was taken.
    dispatcher.before_chunk = lambda: rig.clock.advance(1.0)
    engine = leading_engine(rig, dispatcher)
    engine.step()
    sent = dispatcher.sent_ids()
    assert len(sent) == 20  # chunks at +1 s and +2 s; not at +3 s
    assert engine.stats.withheld == 30 and engine.stats.released == 30
    unsent = [i for i in ids if i not in sent]
    for job_id in unsent:
        job = rig.store.get_by_id(job_id)
        assert job is not None
        assert (job.status, job.attempt) == (JobStatus.PENDING, 0)
    # A successor sends them in its first sweep, long before any
    # visibility timeout.
    dispatcher.before_chunk = None
    successor = rig.engine(rig.elector("b"), dispatcher)
    rig.run(successor, rig.settings.sweep_interval + 1)
    assert sorted(dispatcher.sent_ids()[20:]) == sorted(unsent)


def test_a_forward_wall_clock_step_expires_nothing_early(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 13: store time was wall clock + an offset measured at staging,
    so a forward step of the beat host's clock between two measurements ran
    it ahead of the database, and a job expiring in 10 minutes was expired."""
    jump = dt.timedelta(0)
    engine = Engine(
        store=rig.store,  # the database's clock does not jump
        staging=rig.staging,
        dispatcher=rig.dispatcher,
        elector=rig.elector("a"),
        settings=rig.settings,
        clock=rig.clock.mono,
        wall=lambda: rig.clock.wall() + jump,
    )
    assert engine.elector.try_acquire() is not None
    engine.step()  # measures the store's time
    job_id = rig.add(-1, expires_at=rig.clock.wall() + dt.timedelta(minutes=10))
    real_claim_due = rig.store.claim_due

    def claim_due(**kwargs: Any) -> list[Job]:
        nonlocal jump
        jump = dt.timedelta(hours=1)  # NTP steps the clock during the pass
        return real_claim_due(**kwargs)

    monkeypatch.setattr(rig.store, "claim_due", claim_due)
    rig.run(engine, rig.settings.sweep_interval + 0.5)
    assert rig.dispatcher.sent_ids() == [job_id]
    assert rig.status(job_id) == JobStatus.DISPATCHED
    assert engine.stats.expired == 0
    assert abs(engine.store_now() - rig.store.now()) < dt.timedelta(seconds=1)


def test_the_rescuer_requeues_jobs_of_a_silent_worker_on_its_own_interval(rig: Rig) -> None:
    """Defect 12: a job whose worker process died stayed running for ever."""
    rig.settings = dataclasses.replace(rig.settings, worker_timeout=8.0)  # rescue every 2 s
    job_id = rig.add(-1)
    engine = leading_engine(rig)
    engine.step()
    rig.store.heartbeat("w1", 42)
    assert rig.store.mark_running(job_id, worker="w1", worker_pid=42)
    passes: list[float] = []
    rescue = rig.store.rescue

    def counted(**kwargs: Any) -> Any:
        passes.append(rig.clock.offset)
        return rescue(**kwargs)

    rig.store.rescue = counted  # type: ignore[method-assign]
    rig.run(engine, 7.0)  # the process went silent, but not for worker_timeout yet
    assert rig.status(job_id) == JobStatus.RUNNING
    assert engine.stats.rescued == 0
    rig.run(engine, 4.0 + rig.settings.sweep_interval)
    job = rig.store.get_by_id(job_id)
    assert job is not None and job.attempt == 1
    assert engine.stats.rescued == 1 and engine.stats.requeued == 1
    assert rig.dispatcher.sent_ids() == [job_id, job_id]  # requeued, then sent again
    gaps = [later - earlier for earlier, later in itertools.pairwise(passes)]
    assert gaps and all(abs(gap - 2.0) < 0.15 for gap in gaps)


def test_the_reconciler_drains_in_batches_and_counts_what_moved_before_a_takeover(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sched reconcile`` drains with the loop's reconciler: batches of
    ``limit`` until one comes back short; fenced off mid-way, the counts
    say what the batches before moved."""
    from celery_sched.errors import StaleEpoch
    from celery_sched.leader.reconciler import Reconciler
    from celery_sched.leader.stats import EngineStats

    ids = [rig.add(-1) for _ in range(5)]
    epoch = rig.store.acquire_epoch(0, "a")
    assert len(rig.store.claim_due(shard=0, epoch=epoch, limit=10)) == 5
    rig.clock.advance(rig.settings.visibility_timeout + 1)
    calls: list[int] = []
    real_reconcile = rig.store.reconcile

    def reconcile(**kwargs: Any) -> Any:
        calls.append(kwargs["limit"])
        return real_reconcile(**kwargs)

    monkeypatch.setattr(rig.store, "reconcile", reconcile)
    stats = EngineStats()
    Reconciler(rig.store, rig.settings, stats, limit=2).drain(epoch)
    assert calls == [2, 2, 2]
    assert (stats.requeued, stats.dead) == (5, 0)
    assert {rig.status(i) for i in ids} == {JobStatus.PENDING}

    assert len(rig.store.claim_due(shard=0, epoch=epoch, limit=10)) == 5
    rig.clock.advance(rig.settings.visibility_timeout + 1)

    def reconcile_then_lose_the_lease(**kwargs: Any) -> Any:
        result = real_reconcile(**kwargs)
        rig.store.acquire_epoch(0, "successor")
        return result

    monkeypatch.setattr(rig.store, "reconcile", reconcile_then_lose_the_lease)
    stats = EngineStats()
    with pytest.raises(StaleEpoch):
        Reconciler(rig.store, rig.settings, stats, limit=2).drain(epoch)
    assert (stats.requeued, stats.dead) == (2, 0)


def test_the_leaders_reconciler_moves_a_pass_in_slices_one_per_loop_pass(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #31: one transaction of ``limit`` (here 500) stale rows held
    the single-threaded loop, and every claim, for its whole length; the
    leader moves a pass in slices of SLICE, the next right after the
    dispatching of the next loop pass, and the pass still ends at ``limit``."""
    from celery_sched.leader.reconciler import SLICE

    ids = [rig.add(-1) for _ in range(2 * SLICE + 150)]
    old = rig.store.acquire_epoch(0, "before")
    assert len(rig.store.claim_due(shard=0, epoch=old, limit=1000)) == len(ids)
    rig.clock.advance(rig.settings.visibility_timeout + 1)
    calls: list[int] = []
    real_reconcile = rig.store.reconcile

    def reconcile(**kwargs: Any) -> Any:
        calls.append(kwargs["limit"])
        return real_reconcile(**kwargs)

    monkeypatch.setattr(rig.store, "reconcile", reconcile)
    elector = rig.elector("a")
    elector.try_acquire()
    engine = rig.engine(elector)
    delays = [engine.step() for _ in range(3)]  # the clock stands still
    assert calls == [SLICE, SLICE, 500 - 2 * SLICE]  # the pass: 500 rows
    assert delays[:2] == [0.0, 0.0]  # each slice full: the loop goes on at once
    assert engine.stats.requeued == 500
    engine.step()
    assert len(calls) == 3  # the next pass waits for the interval
    rig.clock.advance(rig.settings.reconcile_interval)
    elector.renew()
    engine.step()
    assert calls[3:] == [SLICE]
    assert engine.stats.requeued == len(ids)
    assert all(rig.store.get_by_id(i).attempt == 1 for i in ids)  # type: ignore[union-attr]


class LegacyStaging(FlakyStaging):
    """Staging that counts the retirements of the set of beats before hash tags."""

    def __init__(self) -> None:
        super().__init__()
        self.drops: list[int] = []

    def drop_legacy(self, shard: int) -> int:
        self._check()
        self.drops.append(shard)
        return 3


@pytest.mark.parametrize("legacy_keys", [False, True])
def test_a_leader_retires_the_legacy_staging_set_once_per_term_once_the_fleet_is_upgraded(
    rig: Rig, legacy_keys: bool
) -> None:
    rig.settings = dataclasses.replace(rig.settings, legacy_lease_keys=legacy_keys)
    rig.staging = staging = LegacyStaging()
    staging.down = True
    elector = rig.elector("a")
    engine = rig.engine(elector)
    engine.step()
    assert staging.drops == []  # standing by: not its business

    assert elector.try_acquire() is not None
    engine.step()  # Redis refuses: tried again next pass
    staging.down = False
    rig.run(engine, 5)
    # Old beats may still lead (and pop the old set) while the lease holds
    # their key too; only once it does not is the set retired, once a term.
    assert staging.drops == ([] if legacy_keys else [0])

    elector.release()
    engine.step()
    assert engine.role == "standby"
    rig.run(engine, 3)
    assert engine.role == "leader"
    assert staging.drops == ([] if legacy_keys else [0, 0])


def test_untracked_jobs_are_sent_once_but_again_when_their_publication_was_not_recorded(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """#30 (1): no worker tracks these tasks. A batch recorded as published
    ends ``sent`` and is never sent again; one whose record failed (the
    store went away right after the publish) is sent again: twice at worst,
    never lost."""
    # The rig's worker tracks every task: let its heartbeat go.
    rig.clock.advance(1)
    assert rig.store.prune_workers(older_than=0.5) == 1
    dispatcher = MemoryDispatcher()
    engine = leading_engine(rig, dispatcher)
    recorded = [rig.add(-1) for _ in range(3)]
    engine.step()
    assert sorted(dispatcher.sent_ids()) == sorted(recorded)

    def store_down(*_args: Any, **_kwargs: Any) -> None:
        raise StoreUnavailable("the store went away")

    unrecorded = [rig.add(-1) for _ in range(2)]
    monkeypatch.setattr(rig.store, "record_published", store_down)
    rig.run(engine, rig.settings.sweep_interval + 1)
    assert sorted(dispatcher.sent_ids()[3:]) == sorted(unrecorded)
    monkeypatch.undo()

    rig.clock.advance(rig.settings.visibility_timeout + 1)
    rig.run(engine, rig.settings.reconcile_interval + rig.settings.sweep_interval + 1)
    assert sorted(dispatcher.sent_ids()[5:]) == sorted(unrecorded)
    for job_id in recorded:
        job = rig.store.get_by_id(job_id)
        assert job is not None and job.status is JobStatus.SENT
