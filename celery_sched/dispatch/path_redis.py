"""The Redis path: each chunk as one pipelined ``LPUSH`` per destination list.

The envelope is exactly what Kombu's Redis transport writes for a
``basic_publish`` to the default exchange (``virtual.Channel.
prepare_message`` + ``_inplace_augment_message`` + ``_put``), built by
:class:`~celery_sched.protocol.RedisEnvelopes`, so a stock worker consumes
it; building it here saves most of the per-message Python work (the
publish benchmark measures the gain). :func:`push_lists` writes a chunk,
with its task-sent events, in one round trip.
:func:`celery_sched.dispatch.fast_path.choose` allows this path per
connection after comparing samples with Kombu's own writes.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import redis.exceptions
from celery.utils.time import utcoffset

from celery_sched.dispatch.connection import PublishConnection
from celery_sched.dispatch.failures import raise_if_server_wide
from celery_sched.dispatch.outgoing import (
    OutgoingMessage,
    announce,
    announce_sent,
    record_sent,
)
from celery_sched.dispatch.sent_events import SentEvents
from celery_sched.protocol import KEY_HEADER, PublishSignals, RedisEnvelopes

logger = logging.getLogger(__name__)

#: Writes a chunk: ``(client, lists, published=())`` -> refused lists.
Push = Callable[..., dict[str, str]]


def eligible(conn: PublishConnection, todo: list[OutgoingMessage]) -> bool:
    """Whether all of ``todo`` can go by this path: messages to the default
    exchange (the queue is the Redis list), without queue expiry."""
    expiring = conn.channel._expires
    return all(m.route.exchange == "" and m.route.routing_key not in expiring for m in todo)


def send(
    conn: PublishConnection,
    todo: list[OutgoingMessage],
    sent: list[uuid.UUID],
    rejected: dict[uuid.UUID, str],
    allowed: Callable[[], bool],
    signals: PublishSignals | None,
    *,
    chunk: int,
    reply_to: str,
    sent_events: SentEvents | None,
    push: Push | None = None,
) -> None:
    """Write ``todo`` in chunks of ``chunk``, removing each job from it once
    its chunk's round trip succeeded (see :meth:`KombuDispatcher._send
    <celery_sched.dispatch.kombu.KombuDispatcher._send>`).

    Multi-value ``LPUSH`` keeps FIFO order: the worker pops from the right.
    A list Redis refuses (WRONGTYPE) fails only the jobs written to it.
    ``push`` writes the lists (the start-up comparison records them;
    default :func:`push_lists`).

    With ``sent_events``, each message's task-sent event is sent by
    ``PUBLISH`` in the same round trip, after the chunk's ``LPUSH``
    commands: an event never announces a message not yet written.
    """
    if push is None:
        push = push_lists  # looked up per call, so a test can replace it
    channel = conn.channel
    envelope = RedisEnvelopes(reply_to).encode
    declared = conn.declared
    min_priority, max_priority = channel.min_priority, channel.max_priority
    q_for_pri = channel._q_for_pri
    keys: dict[tuple[str, int], str] = {}
    if sent_events is not None:
        encode_event = sent_events.encode
        topics = sent_events.topics
        # Nearly always one channel (no fanout patterns).
        topic = topics[0] if len(topics) == 1 else None
        forward = sent_events.clock.forward
    published: list[tuple[str, bytes]] = []
    done = 0
    total = len(todo)
    try:
        with channel.conn_or_acquire() as client:
            while done < total:
                if not allowed():
                    return
                end = min(done + chunk, total)
                lists: dict[str, list[bytes]] = {}
                if sent_events is not None:
                    published = []
                    sent_events.begin(utcoffset())
                # What messages of one route and priority share, looked up
                # once per chunk: the route's declaration, the clamped
                # priority and the list the messages go to.
                slots: dict[tuple[int, Any], tuple[int, list[bytes]]] = {}
                for index in range(done, end):
                    message = todo[index]
                    if rejected and message.job_id in rejected:
                        continue
                    route = message.route
                    slot_key = (id(route), message.priority)
                    slot = slots.get(slot_key)
                    try:
                        if slot is None:
                            entity = route.declare
                            if entity is not None and entity not in declared:
                                conn.declare(route, todo, index)
                            priority = message.priority or 0
                            priority = max(min(int(priority), max_priority), min_priority)
                            list_key = (route.routing_key, priority)
                            key = keys.get(list_key)
                            if key is None:
                                key = keys[list_key] = q_for_pri(route.routing_key, priority)
                            payloads = lists.get(key)
                            if payloads is None:
                                payloads = lists[key] = []
                            slot = slots[slot_key] = (priority, payloads)
                        if signals is not None and message.announced is None:
                            announce(signals, message)
                        payload = envelope(message, slot[0])
                        if sent_events is not None:
                            event = encode_event(message, forward(), time.time())
                            if topic is not None:
                                published.append((topic, event))
                            else:
                                published.extend((each, event) for each in topics)
                    except (TypeError, ValueError) as exc:
                        logger.exception(
                            "cannot encode job %s (task %s)",
                            message.headers.get(KEY_HEADER),
                            message.headers.get("task"),
                        )
                        rejected[message.job_id] = f"cannot encode the message: {exc!r}"
                        continue
                    slot[1].append(payload)
                # A list of a failed slot may be empty: it is not written.
                lists = {key: payloads for key, payloads in lists.items() if payloads}
                if published:
                    refused = push(client, lists, published)
                else:
                    refused = push(client, lists) if lists else {}
                if refused:
                    # Rare: attribute each job of the chunk to its list.
                    for index in range(done, end):
                        message = todo[index]
                        if message.job_id in rejected:
                            continue
                        priority = message.priority or 0
                        priority = max(min(int(priority), max_priority), min_priority)
                        why = refused.get(keys[(message.route.routing_key, priority)])
                        if why is not None:
                            rejected[message.job_id] = why
                record_sent(todo[done:end], rejected, sent)
                if signals is not None:
                    announce_sent(todo[done:end], rejected)
                done = end
    finally:
        del todo[:done]


def push_lists(
    client: Any,
    lists: dict[str, list[bytes]],
    published: Sequence[tuple[str, bytes]] = (),
) -> dict[str, str]:
    """``LPUSH key *payloads`` for each list, then ``PUBLISH channel payload``
    for each of ``published`` (task-sent events): one write, one round trip.

    The commands are packed here: for hundreds of kilobyte-sized values a
    plain join is about ten times faster than redis-py's hiredis packer,
    which took an eighth of the dispatch loop's time. Kombu's
    ``global_keyprefix`` is applied as its own client applies it.

    Each list's reply is read on its own: an error reply about that key
    (WRONGTYPE: the queue name is a key of another type) is returned as
    ``{list: why}`` and the other lists count as written. An error about
    the server (READONLY, LOADING, ...) or any other failure is raised, the
    connection dropped so no unread reply is left on it. An error reply to
    a ``PUBLISH`` that is not about the server loses that event only: it is
    logged, and the messages count as written.
    """
    prefix = getattr(client, "global_keyprefix", None) or ""
    parts: list[bytes] = []
    append = parts.append
    for key, payloads in lists.items():
        name = (prefix + key).encode()
        append(b"*%d\r\n$5\r\nLPUSH\r\n$%d\r\n%s\r\n" % (len(payloads) + 2, len(name), name))
        for payload in payloads:
            append(b"$%d\r\n" % len(payload))
            append(payload)
            append(b"\r\n")
    commands: dict[str, bytes] = {}
    for topic, payload in published:
        command = commands.get(topic)
        if command is None:
            # Kombu's prefixed client prefixes PUBLISH channels too.
            name = (prefix + topic).encode()
            command = commands[topic] = b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n$" % (
                len(name),
                name,
            )
        append(command)
        append(b"%d\r\n" % len(payload))
        append(payload)
        append(b"\r\n")
    pool = client.connection_pool
    conn = pool.get_connection()
    refused: dict[str, str] = {}
    try:
        conn.send_packed_command([b"".join(parts)])
        for key in lists:
            try:
                conn.read_response()
            except redis.exceptions.ResponseError as exc:
                raise_if_server_wide(exc)
                # The whole reply was read: the connection stays in step.
                refused[key] = f"Redis refused list {key!r}: {exc}"
        for topic, _ in published:
            try:
                conn.read_response()
            except redis.exceptions.ResponseError as exc:
                raise_if_server_wide(exc)
                logger.warning("Redis refused a task-sent event on %r: %s", topic, exc)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
    return refused
