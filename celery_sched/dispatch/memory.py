"""An in-memory dispatcher for unit tests: records messages instead of sending them."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from celery_sched.interfaces import Dispatcher, PublishResult
from celery_sched.models import Job, accepted_content_types
from celery_sched.protocol import (
    PublishSignals,
    TaskDefaults,
    base_headers,
    is_expired,
    message_headers,
    send_expires_at,
    task_defaults,
)

DEFAULT_QUEUE = "celery"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PublishedMessage:
    """One message the fake would have put on the broker."""

    job_id: uuid.UUID
    task: str
    headers: dict[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    queue: str
    exchange: str
    routing_key: str
    priority: int | None
    epoch: int
    #: The AMQP TTL in seconds the real dispatcher gives the message.
    expiration: float | None = None


class MemoryDispatcher(Dispatcher):
    """Records published messages; can be told to fail.

    Expiry is judged exactly like the real dispatcher (``expires_at <= now``),
    and a periodic occurrence's ``expires`` counts from the send as there.
    Routing is the job's own ``queue`` / ``exchange`` / ``routing_key``
    options over ``default_queue`` (no ``task_routes``). Given a Celery
    ``app``, the time limits and ``expires`` its tasks declare apply as in
    the real dispatcher (:func:`~celery_sched.protocol.task_defaults`).
    Celery's ``before_task_publish`` / ``after_task_publish`` are sent for
    each recorded message, as the real dispatcher sends them.
    Thread-safe, so an engine thread and a test thread may share it.
    """

    def __init__(
        self,
        *,
        origin: str = "celery_sched@memory",
        default_queue: str = DEFAULT_QUEUE,
        chunk: int = 500,
        app: Any = None,
    ):
        if chunk < 1:
            raise ValueError("chunk must be at least 1")
        self.origin = origin
        self.default_queue = default_queue
        self.chunk = chunk
        #: The Celery app whose tasks' declared options apply (None: none do).
        self.app = app
        self._defaults: dict[str, TaskDefaults | None] = {}
        self.messages: list[PublishedMessage] = []
        self.publish_calls = 0
        self.closed = False
        #: Called before each chunk is sent (a test moves its clock here).
        self.before_chunk: Callable[[], None] | None = None
        self._fail_next = 0
        self._down = False
        self._rejects: dict[uuid.UUID, str] = {}
        self._lock = threading.Lock()

    # -- test controls --------------------------------------------------------

    def fail_next(self, count: int) -> None:
        """Make the next ``count`` messages fail (reported in ``failed``), as if
        the broker dropped the connection for them."""
        if count < 0:
            raise ValueError("count must not be negative")
        with self._lock:
            self._fail_next = count

    def reject(self, job_id: uuid.UUID, reason: str = "unroutable (test)") -> None:
        """Make every publish of ``job_id`` fail on its own (``rejected``), as
        an unroutable or unencodable message does, until :meth:`accept`."""
        with self._lock:
            self._rejects[job_id] = reason

    def accept(self, job_id: uuid.UUID) -> None:
        with self._lock:
            self._rejects.pop(job_id, None)

    def set_down(self, down: bool = True) -> None:
        """Fail every message until called again with ``False`` (broker outage)."""
        with self._lock:
            self._down = down

    def sent_ids(self) -> list[uuid.UUID]:
        """Ids of every recorded message, in publish order (duplicates kept)."""
        with self._lock:
            return [message.job_id for message in self.messages]

    def clear(self) -> None:
        with self._lock:
            self.messages.clear()

    # -- Dispatcher -----------------------------------------------------------

    def publish(
        self,
        jobs: Sequence[Job],
        *,
        epoch: int,
        now: dt.datetime,
        may_publish: Callable[[], bool] | None = None,
    ) -> PublishResult:
        sent: list[uuid.UUID] = []
        failed: list[uuid.UUID] = []
        expired: list[uuid.UUID] = []
        rejected: dict[uuid.UUID, str] = {}
        withheld: list[uuid.UUID] = []
        base = base_headers(origin=self.origin, epoch=epoch)
        with self._lock:
            # Like the Kombu dispatcher: a closed dispatcher reconnects.
            self.closed = False
            self.publish_calls += 1
        # Expiry is judged before anything goes out (or is asked to), so an
        # expired job is reported expired even when nothing may be published.
        todo = [job for job in jobs if not is_expired(job, now)]
        expired.extend(job.id for job in jobs if is_expired(job, now))
        for start in range(0, len(todo), self.chunk):
            chunk = todo[start : start + self.chunk]
            if self.before_chunk is not None:
                self.before_chunk()
            if may_publish is not None and not may_publish():
                withheld.extend(job.id for job in todo[start:])
                break
            recorded: list[PublishedMessage] = []
            with self._lock:
                for job in chunk:
                    if job.id in self._rejects:
                        rejected[job.id] = self._rejects[job.id]
                        continue
                    if self._down or self._fail_next > 0:
                        if self._fail_next > 0:
                            self._fail_next -= 1
                        failed.append(job.id)
                        continue
                    message = self._message(job, base, epoch, now)
                    self.messages.append(message)
                    recorded.append(message)
                    sent.append(job.id)
            if recorded and PublishSignals.connected():
                # Outside the lock: a receiver may call back into the fake. A
                # receiver's header change reaches the recorded (same) dict.
                self._signal(recorded)
        return PublishResult(
            sent=sent, failed=failed, expired=expired, rejected=rejected, withheld=withheld
        )

    def _message(
        self, job: Job, base: dict[str, Any], epoch: int, now: dt.datetime
    ) -> PublishedMessage:
        options = job.options
        defaults = self._task_defaults(job.task)
        expires_at = send_expires_at(job, now, defaults)
        queue = str(options.get("queue") or self.default_queue)
        exchange = str(options.get("exchange") or "")
        routing_key = str(options.get("routing_key") or queue)
        priority = options.get("priority")
        return PublishedMessage(
            job_id=job.id,
            task=job.task,
            headers=message_headers(
                base, job, str(job.id), expires_at=expires_at, defaults=defaults
            ),
            body=job.body,
            content_type=job.content_type,
            content_encoding=job.content_encoding,
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            priority=None if priority is None else int(priority),
            epoch=epoch,
            expiration=None if expires_at is None else (expires_at - now).total_seconds(),
        )

    def _signal(self, messages: list[PublishedMessage]) -> None:
        conf = None if self.app is None else self.app.conf
        signals = PublishSignals(
            reply_to="",
            retry_policy=(conf.task_publish_retry_policy if conf is not None else None) or {},
            accept=accepted_content_types(None if conf is None else conf.accept_content),
        )
        for message in messages:
            announced = signals.before(
                task=message.task,
                task_id=str(message.job_id),
                body=message.body,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                headers=message.headers,
                exchange=message.exchange,
                routing_key=message.routing_key,
                declare=None,
                priority=message.priority,
                expiration=message.expiration,
            )
            signals.after(announced)

    def _task_defaults(self, task: str) -> TaskDefaults | None:
        if self.app is None:
            return None
        try:
            return self._defaults[task]
        except KeyError:
            defaults = self._defaults[task] = task_defaults(self.app.tasks.get(task))
            return defaults

    def close(self) -> None:
        with self._lock:
            self.closed = True
