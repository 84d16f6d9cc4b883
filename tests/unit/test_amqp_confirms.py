"""Publisher confirms bookkeeping (:class:`~celery_sched.dispatch.connection.Confirms`)
against a fake py-amqp channel that replays the acks and nacks RabbitMQ may send."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from celery_sched.dispatch.connection import Confirms
from celery_sched.dispatch.failures import TRANSIENT_ERRORS, ConfirmTimeout
from celery_sched.dispatch.outgoing import OutgoingMessage
from celery_sched.dispatch.routing import Route


class FakeConnection:
    def __init__(self) -> None:
        #: Each drain_events call runs the next of these (or times out).
        self.script: collections.deque[Callable[[], None]] = collections.deque()
        self.drains = 0

    def drain_events(self, timeout: float | None = None) -> None:
        self.drains += 1
        if not self.script:
            raise TimeoutError("timed out")
        self.script.popleft()()


class FakeChannel:
    def __init__(self) -> None:
        self.connection = FakeConnection()
        self.events: dict[str, set[Callable[..., None]]] = collections.defaultdict(set)
        self.selected = 0
        self.raw_publishes: list[Any] = []
        self._confirm_selected = False

    def confirm_select(self) -> None:
        self.selected += 1

    def _basic_publish(self, message: Any, **kwargs: Any) -> None:
        self.raw_publishes.append(message)

    def ack(self, tag: int, multiple: bool = False) -> Callable[[], None]:
        return lambda: [cb(tag, multiple) for cb in list(self.events["basic_ack"])] and None

    def nack(self, tag: int, multiple: bool = False) -> Callable[[], None]:
        return lambda: [cb(tag, multiple) for cb in list(self.events["basic_nack"])] and None


def message() -> OutgoingMessage:
    job_id = uuid.uuid4()
    route = Route(
        exchange="", routing_key="q", queue="q", delivery_mode=2, priority=None, declare=None
    )
    return OutgoingMessage(
        job_id, str(job_id), b"{}", "application/json", "utf-8", {}, route, None, None
    )


def publish(
    confirms: Confirms, channel: FakeChannel, count: int
) -> list[tuple[int, OutgoingMessage]]:
    tagged = []
    for _ in range(count):
        m = message()
        channel.basic_publish(m)  # type: ignore[attr-defined]  # set by Confirms
        tagged.append((confirms.published, m))
    return tagged


def test_confirm_mode_is_selected_and_every_publish_counted_without_waiting() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=1.0)
    assert channel.selected == 1 and channel._confirm_selected
    publish(confirms, channel, 3)
    assert confirms.published == 3 and len(channel.raw_publishes) == 3
    assert channel.connection.drains == 0  # nothing awaited per message


def test_a_chunk_acked_out_of_order_and_in_ranges_is_all_sent() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=1.0)
    tagged = publish(confirms, channel, 6)
    channel.connection.script.extend(
        [
            channel.ack(2),
            channel.ack(1),
            channel.ack(5),
            channel.ack(4, multiple=True),
            channel.ack(6),
        ]
    )
    chunk = [m for _, m in tagged]
    released: list[uuid.UUID] = []
    assert confirms.settle(chunk, tagged, released) == chunk
    assert released == []
    assert not channel.connection.script


def test_a_nack_releases_exactly_its_message() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=1.0)
    tagged = publish(confirms, channel, 4)
    channel.connection.script.extend(
        [channel.ack(2, multiple=True), channel.nack(3), channel.ack(4)]
    )
    chunk = [m for _, m in tagged]
    released: list[uuid.UUID] = []
    taken = confirms.settle(chunk, tagged, released)
    assert released == [chunk[2].job_id]
    assert taken == [chunk[0], chunk[1], chunk[3]]


def test_a_multiple_nack_spares_what_was_acked_before() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=1.0)
    tagged = publish(confirms, channel, 5)
    channel.connection.script.extend(
        [channel.ack(2), channel.nack(4, multiple=True), channel.ack(5)]
    )
    chunk = [m for _, m in tagged]
    released: list[uuid.UUID] = []
    taken = confirms.settle(chunk, tagged, released)
    assert released == [chunk[0].job_id, chunk[2].job_id, chunk[3].job_id]
    assert taken == [chunk[1], chunk[4]]


def test_a_nacked_event_releases_no_job() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=1.0)
    tagged = publish(confirms, channel, 1)
    channel.basic_publish(object())  # type: ignore[attr-defined]  # its task-sent event
    channel.connection.script.extend([channel.ack(1), channel.nack(2)])
    released: list[uuid.UUID] = []
    chunk = [tagged[0][1]]
    assert confirms.settle(chunk, tagged, released) == chunk
    assert released == []


def test_a_later_chunk_does_not_inherit_an_earlier_nack() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=1.0)
    first = publish(confirms, channel, 2)
    channel.connection.script.extend([channel.nack(1), channel.ack(2)])
    released: list[uuid.UUID] = []
    confirms.settle([m for _, m in first], first, released)
    second = publish(confirms, channel, 2)
    channel.connection.script.append(channel.ack(4, multiple=True))
    chunk = [m for _, m in second]
    assert confirms.settle(chunk, second, released) == chunk
    assert released == [first[0][1].job_id]


def test_a_missing_confirm_times_out_as_a_transient_error() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=0.5)
    tagged = publish(confirms, channel, 3)
    channel.connection.script.append(channel.ack(2, multiple=True))
    with pytest.raises(ConfirmTimeout) as caught:
        confirms.settle([m for _, m in tagged], tagged, [])
    assert isinstance(caught.value, TRANSIENT_ERRORS)


def test_a_lost_connection_while_waiting_propagates() -> None:
    channel = FakeChannel()
    confirms = Confirms(channel, timeout=5.0)
    tagged = publish(confirms, channel, 2)

    def lost() -> None:
        raise ConnectionResetError("reset by peer")

    channel.connection.script.append(lost)
    with pytest.raises(ConnectionResetError):
        confirms.settle([m for _, m in tagged], tagged, [])
