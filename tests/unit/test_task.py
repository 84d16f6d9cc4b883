"""celery_sched.Task on in-memory fakes: the ledger protocol, options, retries."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, signals
from celery.exceptions import Retry
from celery.schedules import crontab

import celery_sched
from celery_sched import backends, tracking
from celery_sched import task as task_module
from celery_sched.client import Client
from celery_sched.errors import ConfigurationError, InvalidJob, LedgerConflict, StoreUnavailable
from celery_sched.models import ClaimOutcome, JobStatus, LedgerState
from celery_sched.settings import Settings
from celery_sched.store.memory import MemoryJobStore, MemoryLedger
from celery_sched.task import LeaseKeeper, Task
from tests.contract.conftest import new_job

START = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
LEASE = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


@dataclasses.dataclass
class Env:
    app: Celery
    store: MemoryJobStore
    ledger: MemoryLedger
    clock: Clock
    calls: list[Any]

    def dispatched(self, key: str, **fields: Any) -> uuid.UUID:
        """A job claimed by a leader, as a worker receives it."""
        job = new_job(key, self.store.now() - dt.timedelta(seconds=1), **fields)
        self.store.add_job(job)
        epoch = self.store.acquire_epoch(0, "test")
        self.store.claim_ids([job.id], shard=0, epoch=epoch)
        return job.id

    def deliver(self, name: str, job_id: uuid.UUID, key: str, *args: Any, **headers: Any) -> Any:
        """Run ``name`` as a worker would run the job's message."""
        return self.app.tasks[name].apply(
            args=args, task_id=str(job_id), headers={"celery_sched_key": key, **headers}
        )


@pytest.fixture
def env() -> Iterator[Env]:
    app = Celery("task-test", set_as_current=False, broker="memory://")
    app.conf.task_store_eager_result = False
    clock = Clock()
    store = MemoryJobStore(clock=clock)
    store.heartbeat("worker@test", 4242)  # tracked workers: the reconciler requeues
    ledger = MemoryLedger(clock=clock)
    settings = Settings(ledger_lease=LEASE, ledger_max_result_bytes=64)
    client = Client(app, settings=settings, store=store, staging=False)
    task_module.install(app, settings=settings, store=store, ledger=ledger, client=client)
    calls: list[Any] = []

    @app.task(name="t.charge", base=Task, shared=False)
    def charge(amount: float) -> dict[str, Any]:
        calls.append(amount)
        return {"charged": amount}

    yield Env(app, store, ledger, clock, calls)
    tracking.flush_all()


# -- the ledger protocol ---------------------------------------------------------------


def test_a_new_key_runs_and_is_completed_with_its_result(env: Env) -> None:
    job_id = env.dispatched("order-1")
    result = env.deliver("t.charge", job_id, "order-1", 12.5)
    assert result.get() == {"charged": 12.5}
    assert env.calls == [12.5]
    entry = env.ledger.get("order-1")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert entry.result == {"charged": 12.5} and entry.job_id == job_id
    tracking.flush_all()
    job = env.store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.SUCCEEDED


def test_a_duplicate_delivery_returns_the_recorded_result_without_running(env: Env) -> None:
    job_id = env.dispatched("order-1")
    env.deliver("t.charge", job_id, "order-1", 12.5)
    again = env.deliver("t.charge", job_id, "order-1", 12.5)
    assert again.get() == {"charged": 12.5}
    assert env.calls == [12.5]


def test_a_message_without_a_job_key_is_deduplicated_by_task_id(env: Env) -> None:
    charge = env.app.tasks["t.charge"]
    task_id = str(uuid.uuid4())
    charge.apply(args=(1,), task_id=task_id)
    charge.apply(args=(1,), task_id=task_id)
    charge.apply(args=(1,), task_id=str(uuid.uuid4()))
    assert env.calls == [1, 1]
    assert env.ledger.get(f"task:{task_id}") is not None


def test_a_direct_call_is_a_plain_function_call(env: Env) -> None:
    assert env.app.tasks["t.charge"](3) == {"charged": 3}
    assert env.app.tasks["t.charge"](3) == {"charged": 3}
    assert env.calls == [3, 3]


def test_a_format_string_key_binds_positional_keyword_and_default_arguments(env: Env) -> None:
    @env.app.task(name="t.pay", base=Task, shared=False, idempotency_key="pay:{order}:{currency}")
    def pay(order: int, currency: str = "EUR") -> None:
        env.calls.append((order, currency))

    pay.apply(args=(7,))
    pay.apply(kwargs={"order": 7})
    pay.apply(args=(7, "USD"))
    assert env.calls == [(7, "EUR"), (7, "USD")]
    assert env.ledger.get("pay:7:EUR") is not None and env.ledger.get("pay:7:USD") is not None


def test_a_callable_key_gets_the_task_arguments(env: Env) -> None:
    @env.app.task(
        name="t.ship",
        base=Task,
        shared=False,
        bind=True,
        idempotency_key=lambda order_id, **_: f"ship:{order_id}",
    )
    def ship(self: Any, order_id: int, express: bool = False) -> None:
        env.calls.append(order_id)

    ship.apply(args=(5,))
    ship.apply(args=(5,), kwargs={"express": True})
    assert env.calls == [5]
    assert env.ledger.get("ship:5") is not None


@pytest.mark.parametrize(
    "spec",
    [lambda order: "", lambda order: 42, lambda order: "x" * 600, lambda order: 1 / 0],
)
def test_a_key_that_cannot_be_derived_fails_the_task_without_running_it(
    env: Env, spec: Any
) -> None:
    @env.app.task(name="t.bad_key", base=Task, shared=False, idempotency_key=spec)
    def bad_key(order: int) -> None:
        env.calls.append(order)

    result = bad_key.apply(args=(1,))
    assert result.state == "FAILURE"
    assert isinstance(result.result, InvalidJob)
    assert "t.bad_key" in str(result.result)
    assert env.calls == []


def test_a_failure_releases_the_key_so_that_a_retry_runs(env: Env) -> None:
    outcomes = iter([ValueError("card declined"), None])

    @env.app.task(name="t.flaky", base=Task, shared=False)
    def flaky() -> str:
        env.calls.append("run")
        failure = next(outcomes)
        if failure is not None:
            raise failure
        return "ok"

    job_id = env.dispatched("flaky")
    first = env.deliver("t.flaky", job_id, "flaky")
    assert first.state == "FAILURE"
    assert env.ledger.get("flaky") is None
    assert env.deliver("t.flaky", job_id, "flaky").get() == "ok"
    assert env.calls == ["run", "run"]


def test_a_key_held_under_a_live_lease_is_retried_when_the_lease_expires(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    env.ledger.acquire("busy", owner="other-worker", lease=20)
    retries: list[dict[str, Any]] = []

    def fake_retry(**kwargs: Any) -> Retry:
        retries.append(kwargs)
        return Retry("later", when=kwargs.get("countdown"))

    charge = env.app.tasks["t.charge"]
    monkeypatch.setattr(charge, "retry", fake_retry)
    result = env.deliver("t.charge", env.dispatched("busy"), "busy", 1)
    assert result.state == "RETRY"
    assert env.calls == []
    (retry,) = retries
    assert 20 <= retry["countdown"] <= 21
    assert isinstance(retry["exc"], LedgerConflict) and "other-worker" in str(retry["exc"])
    # Waiting for a busy key is no failure: it never uses up Celery's retries.
    assert retry["max_retries"] == 1


def test_a_key_whose_holder_died_is_taken_over(env: Env) -> None:
    env.ledger.acquire("orphan", owner="dead-worker", lease=LEASE)
    env.clock.advance(LEASE + 1)
    env.deliver("t.charge", env.dispatched("orphan"), "orphan", 2)
    assert env.calls == [2]
    entry = env.ledger.get("orphan")
    assert entry is not None and entry.state == LedgerState.COMPLETED and entry.attempts == 2


def test_a_job_key_reused_after_its_job_was_pruned_runs_the_new_job(env: Env) -> None:
    # Issue 13 (3): the ledger entry outlives the pruned job row; a new job
    # with the same key must run with its own arguments, not return the old
    # result.
    old_id = env.dispatched("order-1")
    assert env.deliver("t.charge", old_id, "order-1", 12.5).get() == {"charged": 12.5}
    tracking.flush_all()
    env.clock.advance(60)
    assert env.store.prune(older_than=30, batch=10) == 1
    assert env.store.get("order-1") is None
    new = env.app.tasks["t.charge"].schedule(args=(99,), key="order-1")
    assert new.id != old_id
    epoch = env.store.acquire_epoch(0, "test")
    env.store.claim_ids([new.id], shard=0, epoch=epoch)
    result = env.deliver("t.charge", new.id, "order-1", *new.args)
    assert result.get() == {"charged": 99}
    assert env.calls == [12.5, 99]
    entry = env.ledger.get("order-1")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert (entry.job_id, entry.result, entry.attempts) == (new.id, {"charged": 99}, 1)
    # Its own duplicate delivery still does not run again.
    assert env.deliver("t.charge", new.id, "order-1", 99).get() == {"charged": 99}
    assert env.calls == [12.5, 99]


def test_an_explicit_idempotency_key_completed_by_an_earlier_job_does_not_run(env: Env) -> None:
    @env.app.task(name="t.keyed", base=Task, shared=False, idempotency_key="pay:{amount}")
    def keyed(amount: int) -> int:
        env.calls.append(amount)
        return amount

    assert env.deliver("t.keyed", env.dispatched("a"), "a", 5).get() == 5
    assert env.deliver("t.keyed", env.dispatched("b"), "b", 5).get() == 5
    assert env.calls == [5]


def test_fenced_deliveries_are_acknowledged_without_running_or_moving_the_row(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 13 (4, 7): the ledger's acquire reads the job row.
    env.ledger.jobs = env.store
    requeued = env.dispatched("requeued", visibility_timeout=5)
    env.clock.advance(10)
    env.store.reconcile(
        shard=0, epoch=env.store.current_epoch(0), limit=10, default_visibility_timeout=300
    )
    job = env.store.get_by_id(requeued)
    assert job is not None and (job.status, job.attempt) == (JobStatus.PENDING, 1)
    # The requeue's copy (attempt 1) started; the first copy arrives late.
    assert env.store.mark_running(requeued, worker="w2", worker_pid=2)
    env.store.add_job(new_job("cancelled", env.store.now() + dt.timedelta(hours=1)))
    assert env.store.cancel("cancelled")
    cancelled = env.store.get("cancelled")
    assert cancelled is not None

    with caplog.at_level(logging.WARNING, logger="celery_sched.task"):
        stale = env.deliver("t.charge", requeued, "requeued", 1, celery_sched_attempt=0)
        gone = env.deliver("t.charge", cancelled.id, "cancelled", 2, celery_sched_attempt=0)
    assert (stale.state, gone.state) == ("IGNORED", "IGNORED")
    assert env.calls == []
    assert "attempt 0 is older than the job's attempt 1" in caplog.text
    assert "the job is cancelled" in caplog.text
    assert env.ledger.get("requeued") is None and env.ledger.get("cancelled") is None
    tracking.flush_all()
    # The stale delivery's start report did not move the requeued row.
    row = env.store.get("requeued")
    assert row is not None and (row.status, row.worker, row.attempt) == (
        JobStatus.RUNNING,
        "w2",
        1,
    )
    assert env.store.get("cancelled").status == JobStatus.CANCELLED  # type: ignore[union-attr]

    # The current attempt runs.
    current = env.deliver("t.charge", requeued, "requeued", 3, celery_sched_attempt=1)
    assert current.get() == {"charged": 3}
    assert env.calls == [3]
    tracking.flush_all()
    assert env.store.get("requeued").status == JobStatus.SUCCEEDED  # type: ignore[union-attr]


def test_a_late_copy_of_a_requeued_job_nobody_started_runs_once_as_its_next_attempt(
    env: Env,
) -> None:
    # The queue was slower than the visibility timeout: the reconciler
    # requeued the job, but its first copy arrives before anyone ran it.
    # That copy takes the job over; the requeue's own copy is then fenced.
    env.ledger.jobs = env.store
    requeued = env.dispatched("slow", visibility_timeout=5)
    env.clock.advance(10)
    env.store.reconcile(
        shard=0, epoch=env.store.current_epoch(0), limit=10, default_visibility_timeout=300
    )
    first = env.deliver("t.charge", requeued, "slow", 7, celery_sched_attempt=0)
    assert first.get() == {"charged": 7}
    tracking.flush_all()
    row = env.store.get("slow")
    assert row is not None and (row.status, row.attempt) == (JobStatus.SUCCEEDED, 2)
    assert row.worker is not None  # its start report named the process
    second = env.deliver("t.charge", requeued, "slow", 7, celery_sched_attempt=1)
    assert second.state == "IGNORED"
    assert env.calls == [7]


def test_an_unavailable_ledger_delays_the_task_instead_of_running_it(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(*args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("postgres is down (test)")

    monkeypatch.setattr(env.ledger, "acquire", down)
    retries: list[dict[str, Any]] = []
    charge = env.app.tasks["t.charge"]
    monkeypatch.setattr(charge, "retry", lambda **kw: retries.append(kw) or Retry("later"))
    assert env.deliver("t.charge", env.dispatched("k"), "k", 1).state == "RETRY"
    assert env.calls == []
    assert retries[0]["countdown"] == pytest.approx(LEASE / 3)


@pytest.mark.parametrize("value", [object(), "x" * 100, float("nan")])
def test_results_that_cannot_be_recorded_are_returned_but_not_replayed(
    env: Env, value: Any
) -> None:
    @env.app.task(name="t.odd", base=Task, shared=False)
    def odd() -> Any:
        env.calls.append("run")
        return value

    job_id = env.dispatched("odd")
    assert env.deliver("t.odd", job_id, "odd").result is value
    duplicate = env.deliver("t.odd", job_id, "odd")
    assert duplicate.result is None
    assert env.calls == ["run"]
    entry = env.ledger.get("odd")
    assert entry is not None and entry.state == LedgerState.COMPLETED and not entry.result_recorded


# -- max_attempts ------------------------------------------------------------------------


def test_an_always_failing_task_is_retried_up_to_max_attempts_then_dead(env: Env) -> None:
    @env.app.task(name="t.doomed", base=Task, shared=False, max_attempts=3, default_retry_delay=0)
    def doomed() -> None:
        env.calls.append("run")
        raise RuntimeError(f"attempt {len(env.calls)} failed")

    job_id = env.dispatched("doomed")
    result = env.deliver("t.doomed", job_id, "doomed")
    assert result.state == "FAILURE"
    assert env.calls == ["run"] * 3
    tracking.flush_all()
    job = env.store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.DEAD
    assert job.last_error == "RuntimeError: attempt 3 failed (attempt 3 of 3); giving up"
    assert env.ledger.get("doomed") is None
    # Celery's per-instance max_retries override must not leak into later runs.
    assert "override_max_retries" not in vars(doomed)


def test_attempts_lost_in_dispatch_count_towards_max_attempts(env: Env) -> None:
    @env.app.task(name="t.doomed2", base=Task, shared=False, max_attempts=3, default_retry_delay=0)
    def doomed2() -> None:
        env.calls.append("run")
        raise RuntimeError("no")

    job_id = env.dispatched("doomed2")
    # The reconciler requeued it twice already (the message carries attempt 2).
    env.deliver("t.doomed2", job_id, "doomed2", celery_sched_attempt=2)
    assert env.calls == ["run"]
    job = env.store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.DEAD


def test_without_max_attempts_a_failure_is_final_as_in_celery(env: Env) -> None:
    @env.app.task(name="t.once", base=Task, shared=False)
    def once() -> None:
        env.calls.append("run")
        raise RuntimeError("no")

    job_id = env.dispatched("once")
    assert env.deliver("t.once", job_id, "once").state == "FAILURE"
    assert env.calls == ["run"]
    tracking.flush_all()
    job = env.store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.FAILED


def test_retry_keeps_the_celery_sched_headers_on_the_new_message(env: Env) -> None:
    sent: list[dict[str, Any]] = []

    def capture(headers: dict[str, Any] | None = None, **_: Any) -> None:
        sent.append(dict(headers or {}))

    signals.before_task_publish.connect(capture, weak=False)
    try:
        charge = env.app.tasks["t.charge"]
        # As a worker builds the request: every message header is an attribute.
        charge.push_request(
            id=str(uuid.uuid4()),
            called_directly=False,
            celery_sched_key="order-9",
            celery_sched_attempt=1,
            celery_sched_epoch=4,
            args=(1,),
            kwargs={},
        )
        try:
            with pytest.raises(Retry):
                charge.retry(countdown=5, headers={"celery_sched_failures": 2})
        finally:
            charge.pop_request()
    finally:
        signals.before_task_publish.disconnect(capture)
    (headers,) = sent
    assert headers["celery_sched_key"] == "order-9"
    assert headers["celery_sched_attempt"] == 1
    assert headers["celery_sched_epoch"] == 4
    assert headers["celery_sched_failures"] == 2


# -- ledger_transaction --------------------------------------------------------------


def test_ledger_transaction_completes_the_key_and_records_the_result_after(env: Env) -> None:
    seen: list[Any] = []

    @env.app.task(name="t.tx", base=Task, shared=False, bind=True)
    def tx(self: Task) -> int:
        with self.ledger_transaction() as conn:
            seen.append(conn)
            entry = env.ledger.get("tx")
            assert entry is not None and entry.state == LedgerState.RUNNING
        entry = env.ledger.get("tx")
        assert entry is not None and entry.state == LedgerState.COMPLETED
        return 41

    job_id = env.dispatched("tx")
    assert env.deliver("t.tx", job_id, "tx").get() == 41
    assert env.deliver("t.tx", job_id, "tx").get() == 41
    assert len(seen) == 1
    assert seen[0].key == "tx"


def test_a_failure_after_ledger_transaction_committed_does_not_rerun(env: Env) -> None:
    @env.app.task(name="t.tx_then_fail", base=Task, shared=False, bind=True)
    def tx_then_fail(self: Task) -> None:
        env.calls.append("run")
        with self.ledger_transaction():
            pass
        raise RuntimeError("after the commit")

    job_id = env.dispatched("tf")
    assert env.deliver("t.tx_then_fail", job_id, "tf").state == "FAILURE"
    entry = env.ledger.get("tf")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert env.deliver("t.tx_then_fail", job_id, "tf").state == "SUCCESS"
    assert env.calls == ["run"]


def test_ledger_transaction_may_be_used_once_per_execution(env: Env) -> None:
    @env.app.task(name="t.twice", base=Task, shared=False, bind=True)
    def twice(self: Task) -> None:
        with self.ledger_transaction():
            pass
        with self.ledger_transaction():
            pass

    result = env.deliver("t.twice", env.dispatched("twice"), "twice")
    assert result.state == "FAILURE"
    assert isinstance(result.result, LedgerConflict)
    assert "one per execution" in str(result.result)


def test_an_execution_whose_key_was_taken_over_ends_without_a_verdict(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    @env.app.task(name="t.slow", base=Task, shared=False, bind=True)
    def slow(self: Task) -> None:
        with self.ledger_transaction():
            # Frozen past the lease: another worker takes the key over.
            env.clock.advance(LEASE + 1)
            claim = env.ledger.acquire("slow", owner="thief", lease=LEASE)
            assert claim.outcome == ClaimOutcome.ACQUIRED

    job_id = env.dispatched("slow")
    with caplog.at_level(logging.WARNING, logger="celery_sched.task"):
        result = env.deliver("t.slow", job_id, "slow")
    assert result.state == "IGNORED"
    assert "taken over" in caplog.text
    entry = env.ledger.get("slow")
    assert entry is not None and entry.state == LedgerState.RUNNING and entry.owner == "thief"
    tracking.flush_all()
    job = env.store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.RUNNING


# -- lease renewal -------------------------------------------------------------------


def test_the_lease_keeper_renews_held_keys_until_their_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    ledger = MemoryLedger(clock=clock)
    keeper = LeaseKeeper(ledger, lease=10)
    for key in ("a", "b", "c"):
        ledger.acquire(key, owner=f"o-{key}", lease=10)
    keeper.hold("a", "o-a")
    keeper.hold("b", "o-b", until=0.0)  # its max_runtime is over: no more renewals
    keeper.hold("c", "o-c")
    clock.advance(11)
    ledger.acquire("c", owner="thief", lease=10)
    with caplog.at_level(logging.WARNING, logger="celery_sched.task"):
        assert keeper.renew_now() == {"a"}
    assert "'c' was taken over" in caplog.text
    keeper.drop("a", "o-a")
    assert keeper.renew_now() == set()


def test_a_running_task_holds_its_key_with_the_keeper(env: Env) -> None:
    @env.app.task(name="t.long", base=Task, shared=False, max_runtime=100)
    def long() -> None:
        runtime = task_module.runtime_for(env.app)
        env.clock.advance(LEASE * 0.9)
        assert runtime.keeper.renew_now() == {"long"}
        env.clock.advance(LEASE * 0.9)
        env.calls.append("still ours")

    env.deliver("t.long", env.dispatched("long"), "long")
    assert env.calls == ["still ours"]
    entry = env.ledger.get("long")
    assert entry is not None and entry.state == LedgerState.COMPLETED
    assert task_module.runtime_for(env.app).keeper.renew_now() == set()


# -- decorator options -------------------------------------------------------------------


def test_binding_a_task_installs_status_tracking() -> None:
    app = Celery("bind-test", set_as_current=False)

    @app.task(name="b.t", base=Task, shared=False)
    def t() -> None:
        return None

    app.finalize()
    assert "celery_sched.tracking" in backends.worker_side(app).installed


def test_a_schedule_option_becomes_the_periodic_schedule(env: Env) -> None:
    every_five = crontab(minute="*/5")

    @env.app.task(
        name="t.report",
        base=Task,
        shared=False,
        schedule=every_five,
        misfire="skip",
        overlap="skip",
    )
    def report() -> None:
        return None

    assert report.periodic_schedule is every_five
    assert callable(report.schedule)
    assert (report.misfire, report.overlap) == ("skip", "skip")
    charge = env.app.tasks["t.charge"]
    for name in (
        "periodic_schedule",
        "schedule_name",
        "schedule_args",
        "schedule_kwargs",
        "schedule_options",
        "schedule_timezone",
        "misfire",
        "overlap",
        "catchup_window",
        "max_catchup",
        "schedule_relative",
    ):
        assert getattr(charge, name) is None, name


def test_schedule_creates_a_job_with_the_decorator_defaults(env: Env) -> None:
    @env.app.task(
        name="t.remind",
        base=Task,
        shared=False,
        visibility_timeout=45,
        max_attempts=4,
        max_runtime=600.0,
        schedule=dt.timedelta(hours=1),
    )
    def remind(user: int) -> None:
        return None

    job = remind.schedule(args=(7,), countdown=60, key="remind-7")
    assert (job.key, job.task, job.args) == ("remind-7", "t.remind", (7,))
    assert (job.visibility_timeout, job.max_attempts, job.max_runtime) == (45, 4, 600.0)
    assert job.due_at == env.store.now() + dt.timedelta(seconds=60)
    other = remind.schedule(args=(8,), max_attempts=1, queue="slow")
    assert other.max_attempts == 1 and other.options["queue"] == "slow"
    assert remind.periodic_schedule == dt.timedelta(hours=1)


def test_client_schedule_and_schedule_many_apply_the_decorator_defaults(env: Env) -> None:
    @env.app.task(name="t.nudge", base=Task, shared=False, max_attempts=2, max_runtime=30.0)
    def nudge(user: int) -> None:
        return None

    client = task_module.client_for(env.app)
    job = client.schedule("t.nudge", (1,), key="nudge-1")
    assert (job.max_attempts, job.max_runtime, job.visibility_timeout) == (2, 30.0, None)
    assert client.schedule("t.nudge", (2,), key="nudge-2", max_attempts=7).max_attempts == 7
    client.schedule_many([{"task": "t.nudge", "args": [3], "key": "nudge-3"}])
    bulk = client.get("nudge-3")
    assert bulk is not None and bulk.max_attempts == 2 and bulk.max_runtime == 30.0


def test_the_client_is_built_once_per_app() -> None:
    app = Celery("client-test", set_as_current=False)
    assert task_module.client_for(app) is task_module.client_for(app)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_attempts": 0}, "max_attempts must be an integer >= 1"),
        ({"max_attempts": 2.5}, "max_attempts must be an integer >= 1"),
        ({"visibility_timeout": -1}, "visibility_timeout must be a positive number"),
        ({"max_runtime": "1h"}, "max_runtime must be a positive number"),
        ({"idempotency_key": 5}, "idempotency_key must be a format string or a callable"),
        ({"idempotency_key": "charge:{order_id}"}, "names 'order_id', which is not a parameter"),
        ({"idempotency_key": "charge:{order"}, "invalid idempotency_key"),
    ],
)
def test_invalid_decorator_options_are_refused_when_the_task_is_created(
    options: dict[str, Any], message: str
) -> None:
    app = Celery("options-test", set_as_current=False)
    with pytest.raises(ConfigurationError, match=message):

        @app.task(name="o.t", base=Task, shared=False, **options)
        def t(order: int) -> None:
            return None

        app.finalize()


def test_task_is_exported_from_the_package() -> None:
    assert celery_sched.Task is Task
    assert Task.acks_late is True
