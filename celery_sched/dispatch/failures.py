"""Which publish failures are retried, and which fail one destination only.

Shared by the three publish paths (:mod:`~celery_sched.dispatch.path_kombu`,
:mod:`~celery_sched.dispatch.path_amqp`, :mod:`~celery_sched.dispatch.path_redis`):
a failure in :data:`TRANSIENT_ERRORS` is retried whole with a fresh connection
by :meth:`KombuDispatcher.publish <celery_sched.dispatch.kombu.KombuDispatcher.publish>`;
a queue, exchange or Redis list the broker refuses raises
:class:`DestinationFailed` for the jobs headed there; anything else raised
while publishing one message is that job's own failure. Neither exception
here leaves the dispatcher: ``publish`` translates them into its result or a
:class:`~celery_sched.errors.PublishError`.
"""

from __future__ import annotations

import uuid

import amqp.exceptions
import redis.exceptions
from kombu.exceptions import (  # type: ignore[attr-defined]  # missing from kombu-stubs
    BatchPublishError,
    OperationalError,
)


class ServerBusy(Exception):
    """A Redis error reply that speaks for the whole server (not one list)."""


#: Failures after which a fresh connection may succeed. Anything else raised
#: while publishing one message (an unroutable task, an unencodable header) is
#: that job's own failure and is not retried; an error reply for one Redis
#: list (WRONGTYPE) or a channel error declaring one queue or exchange fails
#: the jobs of that destination only.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OperationalError,
    BatchPublishError,
    OSError,  # socket errors, ConnectionError, TimeoutError
    amqp.exceptions.ConnectionError,
    amqp.exceptions.ChannelError,
    redis.exceptions.ConnectionError,  # BusyLoadingError (LOADING) included
    redis.exceptions.TimeoutError,
    # Error replies about the server, not the key: a replica after a
    # failover, memory full, a cluster in transition.
    redis.exceptions.ReadOnlyError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    ServerBusy,
)

#: Error replies redis-py leaves unmapped that still concern the whole server.
_SERVER_REPLIES = ("READONLY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "OOM", "BUSY")


def server_wide(exc: redis.exceptions.ResponseError) -> bool:
    """Whether a Redis error reply is about the server rather than one key."""
    return isinstance(exc, TRANSIENT_ERRORS) or str(exc).startswith(_SERVER_REPLIES)


def raise_if_server_wide(exc: redis.exceptions.ResponseError) -> None:
    """Raise ``exc`` (or :class:`ServerBusy` for a reply redis-py leaves
    unmapped) when it is about the whole server; return for a key's own error."""
    if server_wide(exc):
        if isinstance(exc, TRANSIENT_ERRORS):
            raise exc
        raise ServerBusy(str(exc)) from exc


class ConfirmTimeout(TimeoutError):
    """The broker did not confirm a chunk's messages in time (publisher
    confirms): they may or may not be queued, so the chunk is published
    again on a fresh connection (an ``OSError``, hence transient)."""


class DestinationFailed(Exception):
    """One destination (queue, exchange, Redis list) refused its messages;
    ``ids`` are the jobs that were headed there."""

    def __init__(self, ids: list[uuid.UUID], reason: str) -> None:
        super().__init__(reason)
        self.ids = ids
        self.reason = reason
