"""Dispatch: claimed jobs -> Celery protocol-2 messages.

:class:`~celery_sched.dispatch.kombu.KombuDispatcher` publishes through Kombu;
:class:`~celery_sched.dispatch.memory.MemoryDispatcher` records messages for
unit tests. Both build the message headers with the helpers here, so a fake
and the real dispatcher agree on what a worker sees.

The body of every job is stored pre-serialized (``[args, kwargs, embed]`` in
the app's task serializer); dispatch never decodes or re-encodes it.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from celery_sched.models import Job

__all__ = [
    "HEADER_ATTEMPT",
    "HEADER_EPOCH",
    "HEADER_KEY",
    "RESERVED_HEADERS",
    "RESERVED_HEADER_PREFIX",
    "base_headers",
    "is_expired",
    "is_reserved_header",
    "message_headers",
]

#: Our own message headers; a stock worker copies every header into
#: ``task.request``, so ``celery_sched.Task`` reads them there.
HEADER_KEY = "celery_sched_key"
HEADER_ATTEMPT = "celery_sched_attempt"
HEADER_EPOCH = "celery_sched_epoch"


#: Every header a message of ours carries whose name a user's ``headers``
#: option must not take: a stock worker reads them as protocol fields (a
#: ``shadow``, ``eta`` or ``retries`` of the user's would change what runs and
#: when), and ``celery_sched.Task`` trusts its own ``celery_sched_*`` headers
#: (key, attempt, epoch, failures) for the ledger and the fence. The names are
#: those of ``celery.app.amqp.AMQP.as_task_v2`` plus ``celery_beat_task``;
#: a test keeps them in step with the installed Celery.
RESERVED_HEADERS: frozenset[str] = frozenset(
    {
        "lang",
        "task",
        "id",
        "shadow",
        "eta",
        "expires",
        "group",
        "group_index",
        "retries",
        "timelimit",
        "root_id",
        "parent_id",
        "argsrepr",
        "kwargsrepr",
        "origin",
        "ignore_result",
        "replaced_task_nesting",
        "stamped_headers",
        "stamps",
        "celery_beat_task",
    }
)

#: Every header whose name starts with this is ours (present and future ones).
RESERVED_HEADER_PREFIX = "celery_sched_"


def is_reserved_header(name: str) -> bool:
    """Whether a user's ``headers`` option may not use ``name``."""
    return name in RESERVED_HEADERS or name.startswith(RESERVED_HEADER_PREFIX)


def base_headers(*, origin: str, epoch: int) -> dict[str, Any]:
    """The part of the protocol-2 headers that is the same for every job of a batch.

    Keys and defaults follow ``celery.app.amqp.AMQP.as_task_v2``;
    ``celery_beat_task`` is what ``celery.beat`` adds to the tasks it sends.
    """
    return {
        "lang": "py",
        "task": None,
        "id": None,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": None,
        "parent_id": None,
        "argsrepr": None,
        "kwargsrepr": None,
        "origin": origin,
        "ignore_result": False,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
        "celery_beat_task": True,
        HEADER_KEY: None,
        HEADER_ATTEMPT: 0,
        HEADER_EPOCH: epoch,
    }


def message_headers(base: dict[str, Any], job: Job, task_id: str) -> dict[str, Any]:
    """The full headers of ``job``'s message: ``base`` plus the per-job fields.

    One dict literal per message: this is the hot path of a publish. The
    job's own ``headers`` option can only add headers: validation refuses
    reserved names, and any a row stored before that check carries are
    dropped here, so no protocol field (and no ``celery_sched_*`` header)
    ever comes from it.
    """
    options = job.options
    expires_at = job.expires_at
    extra = options.get("headers") if options else None
    if extra:
        extra = {name: value for name, value in extra.items() if not is_reserved_header(name)}
    headers = {
        **(base if not extra else {**base, **extra}),
        "task": job.task,
        "id": task_id,
        "expires": expires_at.isoformat() if expires_at is not None else None,
        "root_id": task_id,
        "argsrepr": job.argsrepr,
        "kwargsrepr": job.kwargsrepr,
        HEADER_KEY: job.key,
        HEADER_ATTEMPT: job.attempt,
    }
    if options:
        if "time_limit" in options or "soft_time_limit" in options:
            headers["timelimit"] = [options.get("time_limit"), options.get("soft_time_limit")]
        if "ignore_result" in options:
            headers["ignore_result"] = bool(options["ignore_result"])
    return headers


def is_expired(job: Job, now: dt.datetime) -> bool:
    """Whether ``job`` must not be sent at ``now`` (the store's clock)."""
    return job.expires_at is not None and job.expires_at <= now
