"""An in-memory dispatcher for unit tests: records messages instead of sending them."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from celery_sched.interfaces import Dispatcher, PublishResult
from celery_sched.models import Job
from celery_sched.protocol import base_headers, is_expired, message_headers

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


class MemoryDispatcher(Dispatcher):
    """Records published messages; can be told to fail.

    Expiry is judged exactly like the real dispatcher (``expires_at <= now``).
    Routing is the job's own ``queue`` / ``exchange`` / ``routing_key``
    options over ``default_queue`` (no ``task_routes``: there is no app).
    Thread-safe, so an engine thread and a test thread may share it.
    """

    def __init__(
        self,
        *,
        origin: str = "celery_sched@memory",
        default_queue: str = DEFAULT_QUEUE,
        chunk: int = 500,
    ):
        if chunk < 1:
            raise ValueError("chunk must be at least 1")
        self.origin = origin
        self.default_queue = default_queue
        self.chunk = chunk
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
                    self.messages.append(self._message(job, base, epoch))
                    sent.append(job.id)
        return PublishResult(
            sent=sent, failed=failed, expired=expired, rejected=rejected, withheld=withheld
        )

    def _message(self, job: Job, base: dict[str, Any], epoch: int) -> PublishedMessage:
        options = job.options
        queue = str(options.get("queue") or self.default_queue)
        exchange = str(options.get("exchange") or "")
        routing_key = str(options.get("routing_key") or queue)
        priority = options.get("priority")
        return PublishedMessage(
            job_id=job.id,
            task=job.task,
            headers=message_headers(base, job, str(job.id)),
            body=job.body,
            content_type=job.content_type,
            content_encoding=job.content_encoding,
            queue=queue,
            exchange=exchange,
            routing_key=routing_key,
            priority=None if priority is None else int(priority),
            epoch=epoch,
        )

    def close(self) -> None:
        with self._lock:
            self.closed = True
