"""``celery_sched.Task``: the idempotent base class for Celery tasks.

``@app.task(base=celery_sched.Task)`` makes each execution go through the
idempotency ledger (:class:`~celery_sched.interfaces.Ledger`) first:

- the task's *idempotency key* is the job key of a celery_sched job (the
  ``celery_sched_key`` message header), else the Celery task id, or what the
  decorator's ``idempotency_key`` derives from the task's arguments;
- a new key is taken under a lease and the task runs; on success the key is
  completed with the result recorded (when it is JSON and small enough);
- a completed key does not run again: the recorded result is returned. The
  rule: a delivery runs unless *its own job* completed under the key, or
  its explicit ``idempotency_key`` completed. With the default key (the job
  key) a completed entry recorded for another job id belongs to an earlier
  job that used the same key (pruned since, so the key became free): the
  new job takes the entry over and runs. With an explicit
  ``idempotency_key`` any completed entry means "do not run";
- a delivery whose job moved on is acknowledged without running (the
  delivery fence, in the same acquire statement): the job is cancelled,
  dead, expired or already succeeded, or it was requeued since this message
  was sent (its ``celery_sched_attempt`` is older than the row's);
- a key held under a live lease (another worker is running it) is retried
  later, after that lease would expire;
- a key whose holder died (its lease expired) is taken over and run;
- a failing execution releases the key, so that a retry can run;
- a key whose take was lost (the take commits asynchronously, so a database
  crash can forget it) is re-created by the completion: only another
  owner's hold makes the completion fail.

The lease is ``celery_sched_ledger_lease`` seconds and a background thread
in each worker process renews the leases it holds every lease/3 seconds, so
a task may run for any length of time (up to the decorator's
``max_runtime``, past which renewal stops) while a worker that dies loses
its keys within one lease. :meth:`Task.ledger_transaction` commits the task's
own writes to the job store's PostgreSQL database together with the key's
completion (exactly-once effects for those writes).

Each worker process builds its ledger from the app's settings on first use
and shares the job store of the status tracking (:mod:`celery_sched.tracking`,
which binding a Task installs for the app): both are the app's
:class:`~celery_sched.backends.WorkerSide`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import json
import logging
import os
import random
import secrets
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, cast

import celery
from celery.exceptions import Ignore, Reject, Retry

from celery_sched import backends, tracking
from celery_sched.errors import (
    CelerySchedError,
    InvalidJob,
    LedgerConflict,
)
from celery_sched.metrics import worker as worker_metrics
from celery_sched.models import ClaimOutcome, JobStatus
from celery_sched.protocol import (
    ATTEMPT_HEADER,
    CARRIED_HEADERS,
    FAILURES_HEADER,
    KEY_HEADER,
    MAX_KEY_LENGTH,
    header,
    header_count,
    request_attempt,
    request_due,
    request_job_id,
)
from celery_sched.validation import check_task_options

if TYPE_CHECKING:
    from celery_sched.client import Client
    from celery_sched.interfaces import JobStore, Ledger
    from celery_sched.models import Job
    from celery_sched.settings import Settings

logger = logging.getLogger(__name__)

#: Longest wait between retries while the ledger's database is unreachable.
MAX_UNAVAILABLE_DELAY = 60.0


# -- per-process resources ---------------------------------------------------------


class LeaseKeeper:
    """Renews the ledger leases this process holds, from one daemon thread.

    Executions register their key while they run; every ``lease / 3``
    seconds one statement extends all of them. A renewal stops at the
    execution's deadline (``max_runtime``), so a hung task eventually lets a
    redelivery take over. Owned by one process (threads do not survive a fork).
    """

    def __init__(self, ledger: Ledger, lease: float) -> None:
        self.ledger = ledger
        self.lease = lease
        self.interval = lease / 3
        self._held: dict[tuple[str, str], float | None] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, key: str, owner: str, *, until: float | None = None) -> None:
        """Keep renewing ``key`` for ``owner`` (until the monotonic deadline ``until``)."""
        with self._lock:
            self._held[(key, owner)] = until
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="celery_sched-ledger-leases", daemon=True
                )
                self._thread.start()

    def drop(self, key: str, owner: str) -> None:
        with self._lock:
            self._held.pop((key, owner), None)

    def renew_now(self) -> set[str]:
        """One renewal round (the thread's work); returns the keys renewed."""
        now = time.monotonic()
        with self._lock:
            due = [pair for pair, until in self._held.items() if until is None or until > now]
        if not due:
            return set()
        try:
            renewed = self.ledger.renew(due, lease=self.lease)
        except CelerySchedError as exc:
            logger.warning("could not renew %d idempotency leases: %s", len(due), exc)
            return set()
        with self._lock:
            lost = [key for key, owner in due if key not in renewed and (key, owner) in self._held]
        for key in lost:
            logger.warning(
                "idempotency key %r was taken over by another execution while this one ran "
                "(its lease expired); this execution will not be recorded as completed",
                key,
            )
        return renewed

    def _run(self) -> None:
        while not self._wake.wait(self.interval):
            self.renew_now()


class TaskRuntime:
    """What celery_sched Tasks of one app use in one process (kept in the
    app's :class:`~celery_sched.backends.WorkerSide`)."""

    def __init__(self, settings: Settings, store: JobStore, ledger: Ledger) -> None:
        self.settings = settings
        self.store = store
        self.ledger = ledger
        self.lease = settings.ledger_lease
        self.max_result_bytes = settings.ledger_max_result_bytes
        self.keeper = LeaseKeeper(ledger, settings.ledger_lease)
        # Owner tokens: unique per execution, cheap to make. The random part
        # keeps a recycled pid on the same host from reusing old tokens.
        self._owner_prefix = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}:"
        self._counter = itertools.count(1)

    def owner(self) -> str:
        return f"{self._owner_prefix}{next(self._counter)}"


def install(
    app: Any,
    *,
    settings: Settings | None = None,
    store: JobStore | None = None,
    ledger: Ledger | None = None,
    client: Client | None = None,
) -> None:
    """Use these backends for ``app``'s celery_sched Tasks in this process.

    Optional: by default each process builds them from the app's settings on
    first use. Tests pass in-memory fakes here; ``store`` also becomes the
    store of the app's status tracking (and stays when a later call gives none).
    """
    given: dict[str, Any] = {"settings": settings, "ledger": ledger, "client": client}
    if store is not None:
        given["store"] = store
    backends.worker_side(app).override(**given)
    tracking.install(app)


def runtime_for(app: Any) -> TaskRuntime:
    """This process's ledger, lease keeper and store for ``app``, built on first use."""
    side = backends.worker_side(app)
    return side.part(TaskRuntime, lambda: TaskRuntime(side.settings, side.store, side.ledger))


def client_for(app: Any) -> Client:
    """The one :class:`~celery_sched.client.Client` of ``app`` in this process."""
    from celery_sched.client import Client

    side = backends.worker_side(app)
    given = side.overrides.client
    if given is not None:
        return cast(Client, given)
    return side.part(Client, lambda: Client(app, settings=side.settings))


# -- the Task base class -------------------------------------------------------------


@dataclasses.dataclass
class _Execution:
    """The ledger state of one running execution (kept on its request)."""

    key: str
    owner: str
    ledger: Ledger
    job_id: uuid.UUID | None = None
    completed: bool = False


class Task(celery.Task[..., Any]):
    """A Celery task whose executions are deduplicated by the idempotency ledger.

    Decorator options (class attributes), besides Celery's own:

    - ``idempotency_key``: a callable over the task's arguments, or a format
      string over them (``"charge:{order_id}"``); default: the job key, else
      the task id.
    - ``max_attempts``: an execution that raises is retried (after Celery's
      ``default_retry_delay``, or exponentially with ``retry_backoff``)
      until this many attempts were made, then the job is marked ``dead``
      with the last error. Unset: exceptions propagate as in plain Celery.
    - ``max_runtime``: lease renewal stops after this many seconds, so a hung
      execution's key can be taken over; also the default for scheduled jobs.
    - ``visibility_timeout``, ``max_attempts``, ``max_runtime`` are the
      defaults of jobs scheduled with :meth:`schedule`.
    - ``schedule=<crontab / interval / ...>`` with ``schedule_name``,
      ``schedule_args``, ``schedule_kwargs``, ``schedule_options``,
      ``schedule_timezone``, ``misfire``, ``overlap``, ``catchup_window``,
      ``max_catchup``, ``schedule_relative``: a periodic schedule of this task
      (read by :func:`celery_sched.schedules.specs_from_app`). The schedule
      object ends up in ``periodic_schedule``; ``schedule()`` stays a method.
    """

    #: Late acknowledgement: a worker that dies mid-task leaves the message
    #: to be redelivered (the ledger makes the redelivery safe) instead of
    #: losing it. ``reject_on_worker_lost`` does the same for a lost child.
    acks_late = True
    reject_on_worker_lost = True

    #: The ledger take applies the delivery fence (always on), so the worker
    #: request class of :mod:`celery_sched.fence` leaves these tasks alone.
    fenced_by_ledger = True

    idempotency_key: str | Callable[..., Any] | None = None
    visibility_timeout: float | None = None
    max_attempts: int | None = None
    max_runtime: float | None = None

    periodic_schedule: Any = None
    schedule_name: str | None = None
    schedule_args: Any = None
    schedule_kwargs: Any = None
    schedule_options: Any = None
    schedule_timezone: str | None = None
    misfire: str | None = None
    overlap: str | None = None
    catchup_window: float | None = None
    max_catchup: int | None = None
    schedule_relative: bool | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Celery turns decorator options into class attributes, so
        # ``schedule=crontab(...)`` would hide the schedule() method.
        if "schedule" in cls.__dict__:
            declared = cls.__dict__["schedule"]
            if not (
                inspect.isfunction(declared) or isinstance(declared, staticmethod | classmethod)
            ):
                delattr(cls, "schedule")
                if declared is not None:
                    cls.periodic_schedule = declared
        # A function stored as a class attribute would be called as a method.
        key_spec = cls.__dict__.get("idempotency_key")
        if inspect.isfunction(key_spec):
            cls.idempotency_key = staticmethod(key_spec)
        check_task_options(cls)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        # Workers report job status without an explicit tracking.install(app).
        tracking.install(app)

    # -- execution ----------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request_stack.top
        if request is None or request.called_directly:
            # A plain function call (mytask(...)): no message, no ledger.
            return super().__call__(*args, **kwargs)
        runtime = runtime_for(self.app)
        key = self._key_for(request, args, kwargs)
        owner = runtime.owner()
        job_id = request_job_id(request, request.id)
        try:
            claim = runtime.ledger.acquire(
                key,
                owner=owner,
                lease=runtime.lease,
                job_id=job_id,
                attempt=request_attempt(request),
                # The job key is this job's own: a completion recorded for
                # another job id is an earlier job's (see the module doc).
                take_completed=self.idempotency_key is None and job_id is not None,
                due_at=request_due(request),
            )
        except CelerySchedError as exc:
            # Without the ledger nobody can tell whether this already ran:
            # wait for the database rather than run blind or give up.
            worker_metrics.count_outcome(worker_metrics.UNAVAILABLE)
            delay = min(MAX_UNAVAILABLE_DELAY, runtime.lease / 3 * 2 ** min(request.retries, 6))
            logger.warning(
                "task %s[%s]: idempotency ledger unavailable (%s); retrying in %.1fs",
                self.name,
                request.id,
                exc,
                delay,
            )
            self._retry_later(request, exc, delay)
        worker_metrics.count_outcome(claim.outcome.value)
        if claim.adopted is not None:
            # This older copy took the job over (nobody had started it since
            # its requeue): it is the job's current attempt from now on, for
            # its status reports, its retries and the fence of later copies.
            setattr(request, ATTEMPT_HEADER, claim.adopted)
            headers = getattr(request, "headers", None)
            if isinstance(headers, dict):
                headers[ATTEMPT_HEADER] = claim.adopted
            tracking.report_running(self, request.id)
        if claim.outcome is ClaimOutcome.FENCED:
            # Acknowledged without a verdict: no status report moves the row
            # (the running report of prerun carries this delivery's attempt,
            # which the store refuses for a stale one; a finished row never
            # moves).
            logger.warning(
                "task %s[%s]: not running this delivery: %s", self.name, request.id, claim.reason
            )
            raise Ignore(claim.reason)
        if claim.outcome is ClaimOutcome.COMPLETED:
            logger.info(
                "task %s[%s]: idempotency key %r was already completed (at %s); not running it "
                "again",
                self.name,
                request.id,
                key,
                claim.completed_at.isoformat() if claim.completed_at else "?",
            )
            return claim.result
        if claim.outcome is ClaimOutcome.HELD:
            delay = claim.retry_in + random.uniform(0.1, 0.5)
            conflict = LedgerConflict(
                f"idempotency key {key!r} is held by {claim.holder}; retrying in {delay:.1f}s"
            )
            logger.info("task %s[%s]: %s", self.name, request.id, conflict)
            self._retry_later(request, conflict, delay)
        return self._run_acquired(runtime, request, key, owner, job_id, args, kwargs)

    def _run_acquired(
        self,
        runtime: TaskRuntime,
        request: Any,
        key: str,
        owner: str,
        job_id: uuid.UUID | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        execution = _Execution(key=key, owner=owner, ledger=runtime.ledger, job_id=job_id)
        request.celery_sched_execution = execution
        until = None if self.max_runtime is None else time.monotonic() + self.max_runtime
        runtime.keeper.hold(key, owner, until=until)
        try:
            result = self.run(*args, **kwargs)
        except LedgerConflict as exc:
            if execution.completed:
                raise  # a second ledger_transaction(): a bug in the task
            # Our lease expired and another execution took the key: it is
            # theirs to finish. Acknowledge this message without a verdict.
            logger.warning("task %s[%s]: %s", self.name, request.id, exc)
            raise Ignore(str(exc)) from exc
        except BaseException as exc:
            if not execution.completed:
                self._release(runtime, key, owner)
                if isinstance(exc, Exception) and not isinstance(exc, Retry | Ignore | Reject):
                    self._after_failure(runtime, request, exc)
            raise
        finally:
            runtime.keeper.drop(key, owner)
        recorded = _encode_result(result, runtime.max_result_bytes)
        if execution.completed and recorded is None:
            return result  # ledger_transaction already completed the key
        try:
            done = runtime.ledger.complete(key, owner=owner, result=recorded, job_id=job_id)
        except CelerySchedError as exc:
            logger.error(
                "task %s[%s]: could not record idempotency key %r as completed (%s); a "
                "duplicate delivery may run it again",
                self.name,
                request.id,
                key,
                exc,
            )
            return result
        if not done:
            logger.warning(
                "task %s[%s]: idempotency key %r was taken over by another execution while "
                "this one ran (its lease expired); both executions ran",
                self.name,
                request.id,
                key,
            )
        return result

    def _release(self, runtime: TaskRuntime, key: str, owner: str) -> None:
        try:
            runtime.ledger.release(key, owner=owner)
        except CelerySchedError as exc:
            logger.warning(
                "could not release idempotency key %r (%s); a retry can take it over once its "
                "lease expires",
                key,
                exc,
            )

    def _after_failure(self, runtime: TaskRuntime, request: Any, exc: Exception) -> None:
        """Retry a failed execution while attempts remain; then mark the job dead."""
        limit = self.max_attempts
        if limit is None or isinstance(exc, InvalidJob):
            return
        failures = header_count(request, FAILURES_HEADER)
        made = header_count(request, ATTEMPT_HEADER) + failures + 1
        if made < limit:
            delay = self._retry_delay(failures)
            logger.warning(
                "task %s[%s] failed (attempt %d of %d: %s: %s); retrying in %.1fs",
                self.name,
                request.id,
                made,
                limit,
                type(exc).__name__,
                exc,
                delay,
            )
            self._retry_later(request, exc, delay, headers={FAILURES_HEADER: failures + 1})
        error = f"{type(exc).__name__}: {exc}"[:2000]
        job_id = request_job_id(request, request.id)
        logger.error(
            "task %s[%s] failed %d of %d attempts, giving up: %s",
            self.name,
            request.id,
            made,
            limit,
            error,
        )
        if job_id is not None:
            reason = f"{error} (attempt {made} of {limit}); giving up"
            try:
                runtime.store.mark_finished(
                    job_id, JobStatus.DEAD, error=reason, due_at=request_due(request)
                )
            except CelerySchedError as store_exc:
                logger.warning("could not mark job %s dead: %s", job_id, store_exc)

    def _retry_later(
        self,
        request: Any,
        exc: Exception,
        countdown: float,
        headers: dict[str, Any] | None = None,
    ) -> NoReturn:
        """Send this message again in ``countdown`` seconds (a Celery retry that
        never counts against ``max_retries``: celery_sched keeps its own count)."""
        try:
            raise self.retry(
                exc=exc, countdown=countdown, max_retries=request.retries + 1, headers=headers
            )
        finally:
            # Celery remembers the override on the shared task instance, where
            # its autoretry would pick it up in a later execution.
            vars(self).pop("override_max_retries", None)

    def _retry_delay(self, failures: int) -> float:
        backoff = getattr(self, "retry_backoff", False)
        if not backoff:
            return float(self.default_retry_delay)
        factor = 1.0 if backoff is True else float(backoff)
        delay = min(factor * 2**failures, float(getattr(self, "retry_backoff_max", 600)))
        if getattr(self, "retry_jitter", True):
            delay = random.uniform(0, delay)
        return float(delay)

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: Any = None,
        throw: bool = True,
        eta: Any = None,
        countdown: Any = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        """Celery's ``retry``, keeping the celery_sched headers on the new message.

        A stock worker exposes message headers as request attributes but does
        not copy them onto a retry; without them the retried run would lose
        its job key (and its status tracking).
        """
        request = self.request_stack.top
        if request is not None and not request.called_directly:
            carried = {
                name: value
                for name in CARRIED_HEADERS
                if (value := header(request, name)) is not None
            }
            if carried:
                options["headers"] = {**carried, **(options.get("headers") or {})}
        return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)

    # -- the idempotency key ------------------------------------------------

    def _key_for(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        spec = self.idempotency_key
        if spec is None:
            key = header(request, KEY_HEADER)
            return str(key) if key else f"task:{request.id}"
        try:
            if isinstance(spec, str):
                key = spec.format(*args, **self._arguments(args, kwargs))
            else:
                key = spec(*args, **kwargs)
        except Exception as exc:
            raise InvalidJob(
                f"task {self.name}: idempotency_key {spec!r} failed for args {args!r} kwargs "
                f"{kwargs!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if type(key) is not str or not key:
            raise InvalidJob(
                f"task {self.name}: idempotency_key must give a non-empty string, got {key!r}"
            )
        if len(key) > MAX_KEY_LENGTH:
            raise InvalidJob(
                f"task {self.name}: idempotency key is {len(key)} characters long; the "
                f"limit is {MAX_KEY_LENGTH}"
            )
        return key

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Mapping[str, Any]:
        """The task's arguments by parameter name, defaults included."""
        signature = _signature_of(self)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return kwargs  # the call itself will fail with Celery's own message
        bound.apply_defaults()
        return bound.arguments

    # -- exactly-once effects -------------------------------------------------

    @contextlib.contextmanager
    def ledger_transaction(self) -> Iterator[Any]:
        """A transaction on the job store's PostgreSQL database that also
        completes this execution's idempotency key when it commits.

        Yields a SQLAlchemy ``Connection``. The statements run on it and the
        key's completion commit together, so a crash before the commit
        leaves neither and a redelivery runs the task again, while after the
        commit a redelivery finds the key completed and does not run. Use it
        once per execution; outside a Celery execution (a direct call) it is
        a plain transaction. If this execution's lease expired and another
        took the key over, the block's writes are rolled back and the
        execution ends without a verdict (the other one finishes the job).
        """
        request = self.request_stack.top
        execution: _Execution | None = getattr(request, "celery_sched_execution", None)
        if execution is None:
            with backends.worker_side(self.app).plain_transaction() as conn:
                yield conn
            return
        if execution.completed:
            raise LedgerConflict(
                f"idempotency key {execution.key!r} was already completed by this execution's "
                "first ledger_transaction(); use one per execution"
            )
        with execution.ledger.transaction(
            execution.key, owner=execution.owner, job_id=execution.job_id
        ) as conn:
            yield conn
        execution.completed = True

    # -- scheduling -----------------------------------------------------------

    def schedule(
        self,
        args: Any = (),
        kwargs: Any = None,
        *,
        eta: Any = None,
        countdown: Any = None,
        key: str | None = None,
        **options: Any,
    ) -> Job:
        """Schedule one job of this task through ``celery_sched.Client(app)``.

        The decorator's ``visibility_timeout``, ``max_attempts`` and
        ``max_runtime`` are the job's defaults; ``options`` override them.
        Raises what :meth:`celery_sched.client.Client.schedule` raises.
        """
        return client_for(self.app).schedule(
            self.name, args, kwargs, eta=eta, countdown=countdown, key=key, **options
        )


# -- helpers -------------------------------------------------------------------------


def _encode_result(result: Any, limit: int) -> str | None:
    """The result as compact JSON text, or ``None`` if it cannot or should not be recorded."""
    try:
        text = json.dumps(result, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None
    # ASCII only (ensure_ascii), so characters are bytes. PostgreSQL's JSONB
    # refuses the NUL character.
    if len(text) > limit or "\\u0000" in text:
        return None
    return text


_signatures: weakref.WeakKeyDictionary[type, inspect.Signature] = weakref.WeakKeyDictionary()


def _signature_of(task: Task) -> inspect.Signature:
    cls = type(task)
    signature = _signatures.get(cls)
    if signature is None:
        signature = _signatures[cls] = inspect.signature(task.run)
    return signature
