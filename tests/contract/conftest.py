"""Fixtures of the contract suites: every backend of an interface, one suite.

The ``store`` fixture yields each :class:`~celery_sched.interfaces.JobStore`
backend in turn. Both use a real clock (the memory store's default clock, and
Postgres ``now()``), so tests place jobs in the past or the far future relative
to ``store.now()`` and sleep briefly where a timeout must pass.

The ``dispatch`` fixture yields each :class:`~celery_sched.interfaces.Dispatcher`
backend in turn, with a way to read back what it published: the memory fake,
and the Kombu dispatcher on Redis and on RabbitMQ, whose messages are read
from the broker as a consumer gets them.

A backend parameter named ``postgres``, ``redis`` or ``amqp`` marks its tests
as needing that service (``tests/conftest.py``).
"""

from __future__ import annotations

import abc
import dataclasses
import datetime as dt
import json
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from celery_sched.interfaces import Dispatcher, JobStore
from celery_sched.models import DueSpan, Job, NewJob

if TYPE_CHECKING:
    from celery_sched.dispatch.memory import MemoryDispatcher


def tracked(store: Any, *tasks: str) -> None:
    """A worker process beats listing ``tasks`` (none: every task), as the
    workers of a tracked deployment do: only then does the reconciler
    requeue a job it finds not started (else it marks it ``sent``)."""
    store.heartbeat("tracker@test", 4242, tasks=list(tasks) if tasks else None)


def due_of(*jobs: Job) -> DueSpan:
    """The due span of ``jobs`` (what a leader passes with their ids)."""
    return DueSpan.of(job.due_at for job in jobs)


def new_job(key: str, due_at: dt.datetime, **fields: Any) -> NewJob:
    """A valid job with a JSON protocol-2 body, due at ``due_at``."""
    body = json.dumps([[1, 2], {"flag": True}, {}]).encode()
    defaults: dict[str, Any] = {
        "id": uuid.uuid4(),
        "task": "tests.add",
        "body": body,
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "argsrepr": "(1, 2)",
        "kwargsrepr": "{'flag': True}",
        "options": {"queue": "celery", "priority": 3, "headers": {"h": "v"}},
    }
    defaults.update(fields)
    return NewJob(key=key, due_at=due_at, **defaults)


@pytest.fixture(params=["memory", "postgres"])
def store(request: pytest.FixtureRequest) -> Iterator[JobStore]:
    backend: JobStore
    if request.param == "memory":
        # Imported per backend, as the dispatchers below are: an import error
        # in one backend's module fails that backend's tests only.
        from celery_sched.store.memory import MemoryJobStore

        backend = MemoryJobStore()
    else:
        from celery_sched.store.postgres import PostgresJobStore

        backend = PostgresJobStore(request.getfixturevalue("settings"))
        backend.migrate()
    yield backend
    backend.close()


# -- Dispatcher -----------------------------------------------------------------------

#: The ``origin`` header every dispatcher of the suite writes (its hostname).
ORIGIN = "celery_sched@contract"
#: A ``queue`` option no backend can route: the Kombu app's ``task_queues``
#: lack it and it may not create queues; the fake is told to refuse it.
UNROUTABLE_QUEUE = "not_in_task_queues"


@dataclasses.dataclass(frozen=True)
class Delivered:
    """One message as a consumer of the backend receives it."""

    queue: str
    headers: dict[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    priority: int | None

    @property
    def task_id(self) -> str:
        return str(self.headers["id"])


class DispatchBackend(abc.ABC):
    """One dispatcher backend with its queues, and what reached them."""

    #: Whether the broker drops a message whose AMQP expiration passed before
    #: anybody consumed it (RabbitMQ does; a TTL rounds down to whole ms).
    drops_expired_messages = False

    def __init__(self, queue: str) -> None:
        #: The app's default queue.
        self.queue = queue
        #: A second queue a job may name in its ``queue`` option.
        self.other_queue = queue + "_other"
        self.dispatchers: list[Dispatcher] = []

    @abc.abstractmethod
    def dispatcher(self, *, chunk: int = 500) -> Dispatcher:
        """A new dispatcher publishing ``chunk`` jobs per chunk."""

    @abc.abstractmethod
    def messages_per_check(self, chunk: int) -> int:
        """How many messages go out between two ``may_publish`` checks."""

    @abc.abstractmethod
    def unreachable(self) -> Dispatcher:
        """A dispatcher whose broker is down."""

    @abc.abstractmethod
    def make_unroutable(self, job_id: uuid.UUID) -> None:
        """Make the job ``job_id`` (whose ``queue`` option is
        :data:`UNROUTABLE_QUEUE`) one whose message this backend refuses."""

    @abc.abstractmethod
    def delivered(self, expected: int) -> list[Delivered]:
        """Take every message from both queues, each queue in arrival order;
        waits (a little) for ``expected`` of them."""

    def close(self) -> None:
        for dispatcher in self.dispatchers:
            dispatcher.close()


class MemoryBackend(DispatchBackend):
    def __init__(self, queue: str) -> None:
        super().__init__(queue)
        self.fakes: list[MemoryDispatcher] = []
        self._refused: set[uuid.UUID] = set()

    def dispatcher(self, *, chunk: int = 500) -> MemoryDispatcher:
        from celery_sched.dispatch.memory import MemoryDispatcher

        fake = MemoryDispatcher(origin=ORIGIN, default_queue=self.queue, chunk=chunk)
        for job_id in self._refused:
            fake.reject(job_id, f"queue {UNROUTABLE_QUEUE!r} is unroutable")
        self.fakes.append(fake)
        self.dispatchers.append(fake)
        return fake

    def messages_per_check(self, chunk: int) -> int:
        return chunk

    def unreachable(self) -> Dispatcher:
        fake = self.dispatcher()
        fake.set_down()
        return fake

    def make_unroutable(self, job_id: uuid.UUID) -> None:
        self._refused.add(job_id)
        for fake in self.fakes:
            fake.reject(job_id, f"queue {UNROUTABLE_QUEUE!r} is unroutable")

    def delivered(self, expected: int) -> list[Delivered]:
        got = [
            Delivered(
                queue=message.queue,
                headers=message.headers,
                body=message.body,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                priority=message.priority,
            )
            for fake in self.fakes
            for message in fake.messages
        ]
        for fake in self.fakes:
            fake.clear()
        return got


class KombuBackend(DispatchBackend):
    def __init__(self, queue: str, broker_url: str, unreachable_url: str) -> None:
        super().__init__(queue)
        self.broker_url = broker_url
        self.unreachable_url = unreachable_url
        self.app = self._app(broker_url)
        # As a worker consuming them would: a queue no job went to can be read.
        with self.app.connection_for_write() as conn:
            for queue in self.app.amqp.queues.values():
                queue.bind(conn.default_channel).declare()

    def _app(self, broker_url: str) -> Any:
        from celery import Celery
        from kombu import Queue

        app = Celery("contract", broker=broker_url, set_as_current=False)
        app.conf.task_default_queue = self.queue
        app.conf.task_queues = [Queue(self.queue), Queue(self.other_queue)]
        app.conf.task_create_missing_queues = False
        return app

    def _settings(self, **fields: Any) -> Any:
        from celery_sched.settings import Settings

        return Settings(hostname=ORIGIN, **fields)

    def dispatcher(self, *, chunk: int = 500) -> Dispatcher:
        from celery_sched.dispatch.kombu import KombuDispatcher

        dispatcher = KombuDispatcher(self.app, self._settings(), chunk=chunk)
        self.dispatchers.append(dispatcher)
        return dispatcher

    def unreachable(self) -> Dispatcher:
        from celery_sched.dispatch.kombu import KombuDispatcher

        dispatcher = KombuDispatcher(
            self._app(self.unreachable_url),
            self._settings(connect_retries=2, retry_backoff=0.01),
            sleep=lambda _seconds: None,
        )
        self.dispatchers.append(dispatcher)
        return dispatcher

    def make_unroutable(self, job_id: uuid.UUID) -> None:
        pass  # the app's task_queues lack UNROUTABLE_QUEUE

    def _take(self, channel: Any) -> list[Delivered]:
        got = []
        for name in (self.queue, self.other_queue):
            while (message := channel.basic_get(name, no_ack=True)) is not None:
                body = message.body
                if isinstance(body, str):  # py-amqp decodes a body with a content_encoding
                    body = body.encode(message.content_encoding)
                properties = message.properties
                got.append(
                    Delivered(
                        queue=name,
                        headers=dict(message.headers),
                        body=body,
                        content_type=message.content_type,
                        content_encoding=message.content_encoding,
                        priority=properties.get("priority"),
                    )
                )
        return got

    def delivered(self, expected: int) -> list[Delivered]:
        # A publish is a socket write: the broker may route it a moment after
        # the dispatcher returned.
        got: list[Delivered] = []
        with self.app.connection_for_read() as conn:
            channel = conn.default_channel
            deadline = time.monotonic() + 5
            while True:
                got += self._take(channel)
                if len(got) >= expected or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            time.sleep(0.1)
            got += self._take(channel)  # anything beyond what was expected
        return got

    def close(self) -> None:
        super().close()
        with self.app.connection_for_write() as conn:
            channel = conn.default_channel
            for name in (self.queue, self.other_queue):
                channel.queue_delete(name)


class RedisBackend(KombuBackend):
    def messages_per_check(self, chunk: int) -> int:
        return chunk  # one pipeline per chunk

    def close(self) -> None:
        import redis

        super().close()
        # queue_delete leaves the exchange bindings Kombu keeps in keys of its own.
        with redis.Redis.from_url(self.broker_url) as client:
            client.delete(*(f"_kombu.binding.{name}" for name in (self.queue, self.other_queue)))


class RabbitMQBackend(KombuBackend):
    drops_expired_messages = True

    def messages_per_check(self, chunk: int) -> int:
        # A chunk awaits its publisher confirms (the default); without them
        # py-amqp publishes one message at a time.
        return chunk if self._settings().publish_confirms else 1


@pytest.fixture(params=["memory", "redis", "amqp"])
def dispatch(request: pytest.FixtureRequest, unique_name: str) -> Iterator[DispatchBackend]:
    backend: DispatchBackend
    if request.param == "memory":
        backend = MemoryBackend(unique_name)
    elif request.param == "redis":
        backend = RedisBackend(
            unique_name, request.getfixturevalue("redis_url"), "redis://127.0.0.1:1/0"
        )
    else:
        backend = RabbitMQBackend(
            unique_name, request.getfixturevalue("amqp_url"), "amqp://guest:guest@127.0.0.1:1//"
        )
    try:
        yield backend
    finally:
        backend.close()
