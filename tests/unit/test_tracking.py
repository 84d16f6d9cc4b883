"""Worker-side status tracking through Celery signals, batched per process."""

from __future__ import annotations

import datetime as dt
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import celery.signals
import pytest
from celery import Celery

from celery_sched import backends, tracking
from celery_sched.errors import StoreError, StoreUnavailable
from celery_sched.models import JobStatus, WorkerUpdate
from celery_sched.settings import Settings
from celery_sched.store.memory import MemoryJobStore
from celery_sched.store.postgres import PostgresJobStore
from tests.contract.conftest import new_job


@pytest.fixture
def app_and_store() -> Iterator[tuple[Celery, MemoryJobStore]]:
    app = Celery("tracking-test", set_as_current=False)
    app.conf.task_always_eager = True
    store = MemoryJobStore()
    tracking.install(app, store=store)

    @app.task(name="t.ok", bind=True, shared=False)
    def ok(self: Any) -> str:
        return "fine"

    @app.task(name="t.boom", shared=False)
    def boom() -> None:
        raise ValueError("boom")

    yield app, store
    tracking.flush_all()


def _dispatched(store: MemoryJobStore, key: str) -> uuid.UUID:
    job = new_job(key, store.now() - dt.timedelta(seconds=1))
    store.add_job(job)
    epoch = store.acquire_epoch(0, "t")
    store.claim_ids([job.id], shard=0, epoch=epoch)
    return job.id


def test_a_job_run_by_a_worker_is_marked_running_then_succeeded(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "ok")
    app.tasks["t.ok"].apply(task_id=str(job_id), headers={"celery_sched_key": "ok"})
    tracking.flush_all()
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.SUCCEEDED
    assert job.started_at is not None


def test_a_failing_job_is_marked_failed_with_the_error(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "boom")
    app.tasks["t.boom"].apply(task_id=str(job_id), headers={"celery_sched_key": "boom"})
    tracking.flush_all()
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.FAILED
    assert job.last_error == "ValueError: boom"


def test_messages_without_celery_sched_headers_are_ignored(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "plain")
    app.tasks["t.ok"].apply(task_id=str(job_id))
    tracking.flush_all()
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.DISPATCHED


def test_reports_are_written_in_batches_by_the_background_thread(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    app, store = app_and_store
    calls: list[int] = []
    original = store.apply_worker_updates

    def counting(updates: Any) -> int:
        calls.append(len(updates))
        return original(updates)

    store.apply_worker_updates = counting  # type: ignore[method-assign]
    ids = [_dispatched(store, f"b{i}") for i in range(50)]
    for job_id in ids:
        app.tasks["t.ok"].apply(task_id=str(job_id), headers={"celery_sched_key": "b"})
    tracking.flush_all()
    assert sum(calls) == 100  # running + succeeded for each
    assert len(calls) < 50  # batched, not one write per report
    assert {store.get_by_id(i).status for i in ids} == {JobStatus.SUCCEEDED}  # type: ignore[union-attr]


class FlakyStore(MemoryJobStore):
    """A memory store whose worker-update writes fail while ``down`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.down: type[Exception] | None = None
        self.attempts = 0

    def apply_worker_updates(self, updates: Any) -> int:
        self.attempts += 1
        if self.down is not None:
            raise self.down("PostgreSQL at postgresql://db is unavailable")
        return super().apply_worker_updates(updates)


def _wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_reports_made_while_the_store_is_down_are_written_once_it_is_back() -> None:
    store = FlakyStore()
    ids = [_dispatched(store, f"o{i}") for i in range(3)]
    store.down = StoreUnavailable
    writer = tracking.StatusWriter(store, interval=0.01, retry_interval=0.05)
    try:
        for job_id in ids:
            writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w1"))
        _wait_for(lambda: store.attempts >= 2)  # failed, kept, tried again
        writer.report(WorkerUpdate(job_id=ids[0], status=JobStatus.SUCCEEDED, worker="w1"))
        assert {store.get_by_id(i).status for i in ids} == {JobStatus.DISPATCHED}  # type: ignore[union-attr]
        store.down = None
        _wait_for(lambda: store.get_by_id(ids[0]).status is JobStatus.SUCCEEDED)  # type: ignore[union-attr]
        assert [store.get_by_id(i).status for i in ids[1:]] == [JobStatus.RUNNING] * 2  # type: ignore[union-attr]
    finally:
        writer.close()


def test_reports_beyond_the_limit_drop_the_oldest_first(caplog: pytest.LogCaptureFixture) -> None:
    store = FlakyStore()
    ids = [_dispatched(store, f"l{i}") for i in range(5)]
    store.down = StoreUnavailable
    writer = tracking.StatusWriter(store, interval=60, retry_interval=60, max_held=3)
    try:
        for job_id in ids:
            writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w1"))
        assert writer.flush() is False
        assert "dropped the 2 oldest job status reports" in caplog.text
        store.down = None
        assert writer.flush() is True
        statuses = [store.get_by_id(i).status for i in ids]  # type: ignore[union-attr]
        assert statuses == [JobStatus.DISPATCHED] * 2 + [JobStatus.RUNNING] * 3
    finally:
        writer.close()


@pytest.mark.parametrize(
    ("error", "final", "kept"),
    [(StoreError, False, False), (StoreUnavailable, True, False), (StoreUnavailable, False, True)],
)
def test_only_an_unavailable_store_keeps_reports_and_only_until_the_last_flush(
    error: type[Exception], final: bool, kept: bool
) -> None:
    store = FlakyStore()
    job_id = _dispatched(store, "k")
    store.down = error
    writer = tracking.StatusWriter(store, interval=60, retry_interval=60)
    try:
        writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w1"))
        writer.flush(final=final)
        store.down = None
        writer.flush()
        job = store.get_by_id(job_id)
        assert job is not None
        assert job.status is (JobStatus.RUNNING if kept else JobStatus.DISPATCHED)
    finally:
        writer.close()


@pytest.fixture
def broker_app() -> Iterator[Celery]:
    """An app that publishes for real, to Kombu's in-process memory transport."""
    app = Celery("tracking-retry-test", broker="memory://", set_as_current=False)
    app.conf.task_default_queue = f"q-{uuid.uuid4().hex[:8]}"
    tracking.install(app, store=MemoryJobStore())

    @app.task(name="t.flaky", bind=True, shared=False)
    def flaky(self: Any) -> None:
        raise AssertionError("never executed here")

    yield app


def _published_headers(app: Celery) -> dict[str, Any]:
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue(app.conf.task_default_queue)
        try:
            message = queue.get(timeout=1)
            message.ack()
            return dict(message.headers)
        finally:
            queue.close()


def _inside(app: Celery, task_id: str, **headers: Any) -> Any:
    """Make ``t.flaky`` the running task, as a worker does, with these headers."""
    from celery._state import _task_stack

    task = app.tasks["t.flaky"]
    task.push_request(id=task_id, called_directly=False, retries=0, **headers)
    _task_stack.push(task)
    return task


def _leave(task: Any) -> None:
    from celery._state import _task_stack

    _task_stack.pop()
    task.pop_request()


def test_a_plain_task_retry_keeps_the_job_headers(broker_app: Celery) -> None:
    # Tracking relies on this: Celery (>= 5.7) keeps a request's custom headers
    # on the message a retry publishes, so the retried run is the same job.
    job_id = str(uuid.uuid4())
    task = _inside(
        broker_app,
        job_id,
        celery_sched_key="job-7",
        celery_sched_attempt=2,
        celery_sched_epoch=9,
    )
    try:
        task.retry(countdown=60, throw=False)
    finally:
        _leave(task)
    headers = _published_headers(broker_app)
    assert headers["id"] == job_id
    assert headers["celery_sched_key"] == "job-7"
    assert headers["celery_sched_attempt"] == 2
    assert headers["celery_sched_epoch"] == 9


def test_other_messages_sent_from_a_task_do_not_get_its_headers(broker_app: Celery) -> None:
    task = _inside(broker_app, str(uuid.uuid4()), celery_sched_key="job-8")
    try:
        broker_app.send_task("t.flaky", task_id=str(uuid.uuid4()))
    finally:
        _leave(task)
    headers = _published_headers(broker_app)
    assert "celery_sched_key" not in headers


# -- issue 13 (2): one bad report never breaks a worker's reporting -----------


def _postgres_app(settings: Settings) -> tuple[Celery, PostgresJobStore]:
    store = PostgresJobStore(settings)
    store.migrate()
    app = Celery("tracking-pg-test", set_as_current=False)
    app.conf.task_always_eager = True
    tracking.install(app, store=store)

    @app.task(name="t.ok", shared=False)
    def ok() -> str:
        return "fine"

    @app.task(name="t.raises", shared=False)
    def raises(message: str) -> None:
        raise OSError(message)

    return app, store


def _pg_dispatched(store: PostgresJobStore, key: str) -> uuid.UUID:
    job = new_job(key, store.now() - dt.timedelta(seconds=1))
    store.add_job(job)
    epoch = store.current_epoch(0) or store.acquire_epoch(0, "t")
    assert store.claim_ids([job.id], shard=0, epoch=epoch)
    return job.id


def test_a_nul_in_an_error_costs_no_report_of_the_batch(settings: Settings) -> None:
    # PostgreSQL text refuses NUL: it used to drop the whole batch.
    app, store = _postgres_app(settings)
    try:
        before = _pg_dispatched(store, "before")
        bad = _pg_dispatched(store, "nul")
        after = _pg_dispatched(store, "after")
        app.tasks["t.ok"].apply(task_id=str(before), headers={"celery_sched_key": "before"})
        app.tasks["t.raises"].apply(
            args=("bad\x00byte",), task_id=str(bad), headers={"celery_sched_key": "nul"}
        )
        app.tasks["t.ok"].apply(task_id=str(after), headers={"celery_sched_key": "after"})
        tracking.flush_all()
        assert [store.get_by_id(i).status for i in (before, bad, after)] == [  # type: ignore[union-attr]
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.SUCCEEDED,
        ]
        assert store.get_by_id(bad).last_error == "OSError: bad\ufffdbyte"  # type: ignore[union-attr]
    finally:
        tracking.flush_all()
        store.close()


def test_a_surrogate_in_an_error_leaves_the_writer_working(settings: Settings) -> None:
    # A file name that is not UTF-8 (os.fsdecode gives lone surrogates): the
    # encoding error used to kill the writer thread, so nothing was written again.
    app, store = _postgres_app(settings)
    try:
        bad = _pg_dispatched(store, "surrogate")
        app.tasks["t.raises"].apply(
            args=("cannot open " + os.fsdecode(b"/tmp/caf\xe9"),),
            task_id=str(bad),
            headers={"celery_sched_key": "surrogate"},
        )
        writer = tracking.writer_for(app)
        _wait_for(lambda: store.get_by_id(bad).status is JobStatus.FAILED)  # type: ignore[union-attr]
        assert store.get_by_id(bad).last_error == "OSError: cannot open /tmp/caf?"  # type: ignore[union-attr]
        later = _pg_dispatched(store, "later")
        app.tasks["t.ok"].apply(task_id=str(later), headers={"celery_sched_key": "later"})
        _wait_for(lambda: store.get_by_id(later).status is JobStatus.SUCCEEDED)  # type: ignore[union-attr]
        assert writer.alive and tracking.writer_for(app) is writer
    finally:
        tracking.flush_all()
        store.close()


class PickyStore(MemoryJobStore):
    """A memory store that refuses any batch holding a report of ``bad``."""

    def __init__(self, error: type[Exception]) -> None:
        super().__init__()
        self.error = error
        self.bad: set[uuid.UUID] = set()

    def apply_worker_updates(self, updates: Any) -> int:
        if any(update.job_id in self.bad for update in updates):
            raise self.error("the store refuses this batch")
        return super().apply_worker_updates(updates)


@pytest.mark.parametrize("error", [StoreError, RuntimeError, UnicodeEncodeError])
def test_only_the_report_the_store_refuses_is_dropped(error: type[Exception]) -> None:
    store = PickyStore(StoreError if error is UnicodeEncodeError else error)
    if error is UnicodeEncodeError:
        # What psycopg raised for a lone surrogate, before reports were cleaned.
        def refuse(updates: Any) -> int:
            if any(update.job_id in store.bad for update in updates):
                "\udcff".encode()
            return MemoryJobStore.apply_worker_updates(store, updates)

        store.apply_worker_updates = refuse  # type: ignore[method-assign]
    ids = [_dispatched(store, f"p{i}") for i in range(9)]
    store.bad = {ids[4]}
    writer = tracking.StatusWriter(store, interval=60, retry_interval=60)
    try:
        for job_id in ids:
            writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w"))
        assert writer.flush() is True
        statuses = [store.get_by_id(i).status for i in ids]  # type: ignore[union-attr]
        assert (
            statuses == [JobStatus.RUNNING] * 4 + [JobStatus.DISPATCHED] + [JobStatus.RUNNING] * 4
        )
    finally:
        writer.close()


def test_the_writer_thread_survives_what_a_write_raises() -> None:
    store = PickyStore(RuntimeError)
    bad, good = _dispatched(store, "bad"), _dispatched(store, "good")
    store.bad = {bad}
    writer = tracking.StatusWriter(store, interval=0.01, retry_interval=0.01)
    try:
        writer.report(WorkerUpdate(job_id=bad, status=JobStatus.RUNNING, worker="w"))
        time.sleep(0.1)
        writer.report(WorkerUpdate(job_id=good, status=JobStatus.RUNNING, worker="w"))
        _wait_for(lambda: store.get_by_id(good).status is JobStatus.RUNNING)  # type: ignore[union-attr]
        assert writer.alive
    finally:
        writer.close()


def test_a_writer_whose_thread_died_is_replaced_and_its_reports_written(
    app_and_store: tuple[Celery, MemoryJobStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "orphaned-report")
    tracking.flush_all()
    backends.worker_side(app).replace_part(tracking.StatusWriter, None)
    # A thread that ends at once stands in for one killed by a bug.
    monkeypatch.setattr(tracking.StatusWriter, "_run", lambda self: None)
    dead = tracking.writer_for(app)
    dead._thread.join()
    dead.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w"))
    monkeypatch.undo()
    writer = tracking.writer_for(app)
    assert writer is not dead and writer.alive
    _wait_for(lambda: store.get_by_id(job_id).status is JobStatus.RUNNING)  # type: ignore[union-attr]


# -- issue 13 (12): heartbeats, pids and lost worker processes ----------------


class BeatCountingStore(MemoryJobStore):
    def __init__(self) -> None:
        super().__init__()
        self.beats: list[tuple[str, int, bool]] = []
        self.tasks: list[list[str] | None] = []

    def heartbeat(
        self,
        hostname: str,
        pid: int,
        *,
        first: bool = False,
        tasks: Sequence[str] | None = None,
    ) -> None:
        self.beats.append((hostname, pid, first))
        self.tasks.append(None if tasks is None else list(tasks))
        super().heartbeat(hostname, pid, first=first, tasks=tasks)


def test_the_writer_beats_for_its_process_once_it_started_a_job() -> None:
    store = BeatCountingStore()
    job_id = _dispatched(store, "beats")
    writer = tracking.StatusWriter(store, interval=0.01, heartbeat_interval=0.05)
    try:
        time.sleep(0.1)
        assert store.beats == []  # no job started here yet
        pid = os.getpid()
        writer.report(
            WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker="w@h", worker_pid=pid)
        )
        _wait_for(lambda: len(store.beats) >= 3)
        assert store.beats[0] == ("w@h", pid, True)  # the first beat resets started_at
        assert set(store.beats[1:]) == {("w@h", pid, False)}
        assert ("w@h", pid) in store._workers
    finally:
        writer.close()
    job = store.get_by_id(job_id)
    assert job is not None and (job.status, job.worker_pid) == (JobStatus.RUNNING, os.getpid())


def test_beats_list_the_tasks_this_process_tracks() -> None:
    # #15 (1): the reconciler requeues only jobs of tasks some worker tracks.
    store = BeatCountingStore()
    writer = tracking.StatusWriter(
        store, interval=0.01, heartbeat_interval=0.05, tasks=["t.b", "t.a"]
    )
    try:
        writer.watch("w@h")
        _wait_for(lambda: len(store.beats) >= 2)
        assert store.beats[0] == ("w@h", os.getpid(), True)
        assert set(map(tuple, filter(None, store.tasks))) == {("t.a", "t.b")}
        assert None not in store.tasks
    finally:
        writer.close()


class _Consumer:
    """What ``worker_ready`` sends: a worker's consumer (hashable, as Celery's)."""

    def __init__(self, app: Celery, hostname: str) -> None:
        self.app = app
        self.hostname = hostname


def test_a_worker_beats_from_its_start_listing_the_apps_tasks(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    # Before any job ran here, the main process announces what it tracks, so
    # a job whose message is lost is requeued, not marked sent.
    app, store = app_and_store
    listed = tracking.tracked_tasks(app)
    assert {"t.boom", "t.ok"} <= set(listed) and listed == sorted(listed)
    assert not any(name.startswith("celery.") for name in listed)  # Celery's own
    celery.signals.worker_ready.send(sender=_Consumer(app, "celery@ready"))
    _wait_for(lambda: ("celery@ready", os.getpid()) in store._workers)
    assert store._worker_tasks[("celery@ready", os.getpid())] == frozenset(listed)
    # An app without tracking does not beat.
    other = Celery("untracked", set_as_current=False)
    celery.signals.worker_ready.send(sender=_Consumer(other, "x@y"))
    time.sleep(0.1)
    assert not any(host == "x@y" for host, _ in store._workers)


def test_a_running_report_carries_the_pid(app_and_store: tuple[Celery, MemoryJobStore]) -> None:
    app, store = app_and_store
    job_id = _dispatched(store, "with-pid")

    @app.task(name="t.checks", bind=True, shared=False)
    def checks(self: Any) -> None:
        tracking.flush_all()
        job = store.get_by_id(job_id)
        assert job is not None and job.worker_pid == os.getpid()

    result = app.tasks["t.checks"].apply(task_id=str(job_id), headers={"celery_sched_key": "p"})
    assert result.successful(), result.traceback


def _lose(
    app: Celery, task_name: str, job_id: uuid.UUID, exc: BaseException, **headers: Any
) -> None:
    """Send task_failure as a worker's main process does for a lost child:
    the delivery's request pushed on the task."""
    from celery import signals

    task = app.tasks[task_name]
    task.push_request(id=str(job_id), **headers)
    try:
        signals.task_failure.send(sender=task, task_id=str(job_id), exception=exc)
    finally:
        task.pop_request()


def test_a_lost_child_requeues_its_job_at_once(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    from billiard.exceptions import WorkerLostError

    app, store = app_and_store
    job_id = _dispatched(store, "lost")
    store.mark_running(job_id, worker="w", worker_pid=12345)
    lost = WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL) Job: 0.")
    _lose(app, "t.ok", job_id, lost, celery_sched_key="lost", celery_sched_attempt=0)
    tracking.flush_all()
    job = store.get_by_id(job_id)
    assert job is not None
    assert (job.status, job.attempt) == (JobStatus.PENDING, 1)
    assert job.last_error is not None
    assert job.last_error.startswith("its worker process was lost: WorkerLostError: Worker exited")


def test_other_failures_and_foreign_messages_are_left_to_task_postrun(
    app_and_store: tuple[Celery, MemoryJobStore],
) -> None:
    from billiard.exceptions import WorkerLostError

    app, store = app_and_store
    job_id = _dispatched(store, "not-lost")
    store.mark_running(job_id, worker="w", worker_pid=1)
    _lose(app, "t.ok", job_id, ValueError("an ordinary failure"), celery_sched_key="not-lost")
    _lose(app, "t.ok", job_id, WorkerLostError("no celery_sched headers"))
    _lose(
        app,
        "t.ok",
        job_id,
        WorkerLostError("an older delivery"),
        celery_sched_key="not-lost",
        celery_sched_attempt=3,
    )
    tracking.flush_all()
    assert store.get_by_id(job_id).status is JobStatus.RUNNING  # type: ignore[union-attr]


# -- issue 13 (12): a retrying report says when its retry is due -----------------------


class RecordingStore(MemoryJobStore):
    """A memory store that keeps every worker report it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list[WorkerUpdate] = []

    def apply_worker_updates(self, updates: Any) -> int:
        self.updates.extend(updates)
        return super().apply_worker_updates(updates)


@pytest.mark.parametrize(
    ("when", "expected"),
    [
        (30, 30.0),
        (2.5, 2.5),
        (0, 0.0),
        (-5, 0.0),  # overdue: due now
        ("eta+120", 120.0),
        ("naive-eta+120", 120.0),  # a naive ETA is UTC, as the worker reads it
        ("iso-eta+120", 120.0),
        ("eta-60", 0.0),
        (None, None),
        (float("nan"), None),
        ("not a date", None),
        (1e300, tracking.REPORT_RETRY_IN_LIMIT),
    ],
)
def test_the_delay_of_a_retry_comes_from_its_countdown_or_eta(
    when: Any, expected: float | None
) -> None:
    from celery.exceptions import Retry

    now = dt.datetime.now(dt.UTC)
    if isinstance(when, str) and "eta" in when:
        eta = now + dt.timedelta(seconds=float(when.rpartition("eta")[2]))
        if when.startswith("naive"):
            when = eta.replace(tzinfo=None)
        elif when.startswith("iso"):
            when = eta.isoformat()
        else:
            when = eta
    retry_in = tracking._retry_in(Retry(when=when))
    if expected is None:
        assert retry_in is None
    else:
        assert retry_in is not None
        assert expected - 2 <= retry_in <= expected, retry_in
    assert tracking._retry_in(ValueError("not a retry")) is None


@pytest.mark.parametrize("how", ["countdown", "eta"])
def test_a_retry_report_carries_the_delay_and_the_store_keeps_when_it_is_due(how: str) -> None:
    # Issue 13 (12), seen in the chaos soak: a retry's message was lost with
    # the broker and its job stayed retrying for ever; the report now says
    # when the retry is due, for the reconciler.
    app = Celery("tracking-retry", set_as_current=False)
    app.conf.task_always_eager = True
    store = RecordingStore()
    tracking.install(app, store=store)
    seen: list[dt.datetime | None] = []

    @app.task(name="t.retries", bind=True, shared=False)
    def retries(self: Any) -> str:
        if self.request.retries == 0:
            if how == "countdown":
                raise self.retry(countdown=30)
            raise self.retry(eta=dt.datetime.now(dt.UTC) + dt.timedelta(seconds=30))
        # The eager retry runs at once: the first run's reports are written.
        tracking.flush_all()
        job = store.get_by_id(job_id)
        assert job is not None
        seen.append(job.dispatched_at)
        return "done"

    job_id = _dispatched(store, f"retried-{how}")
    before = store.now()
    result = app.tasks["t.retries"].apply(
        task_id=str(job_id), headers={"celery_sched_key": f"retried-{how}"}
    )
    assert result.successful(), result.traceback
    tracking.flush_all()
    retrying = [u for u in store.updates if u.status == JobStatus.RETRYING]
    assert len(retrying) == 1
    assert retrying[0].retry_in is not None and 28 <= retrying[0].retry_in <= 30
    # The retrying row's dispatched_at was set 30 s ahead ...
    assert seen and seen[0] is not None
    assert before + dt.timedelta(seconds=28) <= seen[0] <= store.now() + dt.timedelta(seconds=30)
    # ... and the retry's own run went on as before: running, then succeeded.
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.SUCCEEDED


def test_a_retrying_report_is_written_at_once() -> None:
    # The retry's message is already sent: another process may start it
    # within milliseconds, and that start is refused unless the job is
    # retrying by then (the row would then say retrying while the retry
    # runs, and be requeued a visibility timeout after its ETA).
    store = RecordingStore()
    job_id = _dispatched(store, "urgent")
    writer = tracking.StatusWriter(store, interval=30.0)
    try:
        writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RUNNING, worker=None))
        time.sleep(0.2)
        assert store.updates == []  # an ordinary report waits for the interval
        writer.report(WorkerUpdate(job_id=job_id, status=JobStatus.RETRYING, retry_in=5))
        _wait_for(lambda: len(store.updates) == 2, timeout=2.0)
    finally:
        writer.close()
    job = store.get_by_id(job_id)
    assert job is not None and job.status == JobStatus.RETRYING
