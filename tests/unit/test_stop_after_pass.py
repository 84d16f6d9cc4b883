"""A beat told to stop (SIGTERM, SIGINT) finishes the pass it is in first, so
jobs it claimed are published or released instead of waiting a visibility
timeout for the reconciler; a second signal stops it at once."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import pytest

from celery_sched.beat import Scheduler, StopAfterPass


@pytest.fixture
def received() -> Iterator[list[int]]:
    """Signals seen by a stand-in for beat's own handler, installed for
    SIGTERM and SIGINT; the original handlers are put back afterwards."""
    seen: list[int] = []
    originals = {signum: signal.getsignal(signum) for signum in StopAfterPass.SIGNALS}

    def beats_handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    for signum in StopAfterPass.SIGNALS:
        signal.signal(signum, beats_handler)
    yield seen
    for signum, handler in originals.items():
        signal.signal(signum, handler)


def deliver(signum: int) -> None:
    """Send ``signum`` to this process and give Python the chance to run its
    handler (it runs between bytecodes of the main thread)."""
    os.kill(os.getpid(), signum)
    for _ in range(20):
        time.sleep(0.001)


def test_a_signal_during_a_pass_waits_for_its_end(received: list[int]) -> None:
    guard = StopAfterPass()
    assert guard.install()
    with guard.running():
        deliver(signal.SIGTERM)
        assert received == []
    assert received == [signal.SIGTERM]


def test_a_second_signal_during_the_pass_acts_at_once(received: list[int]) -> None:
    guard = StopAfterPass()
    guard.install()
    with guard.running():
        deliver(signal.SIGINT)
        assert received == []
        deliver(signal.SIGTERM)
        assert received == [signal.SIGTERM]
    # The first one was handed over with the second: nothing left to run.
    assert received == [signal.SIGTERM]


def test_a_signal_between_passes_acts_at_once(received: list[int]) -> None:
    guard = StopAfterPass()
    guard.install()
    with guard.running():
        pass
    deliver(signal.SIGTERM)
    assert received == [signal.SIGTERM]


def test_nothing_is_wrapped_outside_the_main_thread(received: list[int]) -> None:
    import threading

    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(StopAfterPass().install()))
    thread.start()
    thread.join()
    assert result == [False]
    handler = signal.getsignal(signal.SIGTERM)
    assert not isinstance(getattr(handler, "__self__", None), StopAfterPass)


class SignalledFleet:
    """A fleet whose pass is told to stop halfway through."""

    def __init__(self) -> None:
        self.finished = 0

    def step(self) -> float:
        deliver(signal.SIGTERM)
        self.finished += 1
        return 1.0


def test_beat_stops_only_once_the_pass_it_was_in_has_ended(received: list[int]) -> None:
    stopped_after: list[int] = []
    fleet = SignalledFleet()

    def beats_sync_handler(signum: int, frame: Any) -> None:
        # What celery beat's own handler does: close, then SystemExit.
        stopped_after.append(fleet.finished)
        raise SystemExit()

    signal.signal(signal.SIGTERM, beats_sync_handler)
    scheduler = Scheduler.__new__(Scheduler)
    scheduler._fleet = fleet
    scheduler._stop_guard = None
    with pytest.raises(SystemExit):
        scheduler.tick()
    assert stopped_after == [1], "beat's handler ran before the pass ended"
