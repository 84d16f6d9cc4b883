"""The leader's garbage-collector settings: frozen once, young threshold raised, never lowered."""

from __future__ import annotations

import gc

import pytest

from celery_sched.leader import loop


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    calls: list[object] = []
    threshold = [700, 10, 10]
    monkeypatch.setattr(loop, "_heap_frozen", False)

    def collect(*args: object) -> int:
        calls.append("collect")
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "get_threshold", lambda: tuple(threshold))

    def set_threshold(*values: int) -> None:
        calls.append(("set_threshold", values))
        threshold[:] = values

    monkeypatch.setattr(gc, "set_threshold", set_threshold)
    return calls


def test_the_heap_is_collected_then_frozen_once_and_the_young_threshold_raised(
    recorded: list[object],
) -> None:
    loop.freeze_heap_once()
    loop.freeze_heap_once()
    assert recorded == [
        "collect",
        "freeze",
        ("set_threshold", (loop.YOUNG_GC_THRESHOLD, 10, 10)),
    ]


def test_a_larger_young_threshold_is_kept(
    recorded: list[object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gc, "get_threshold", lambda: (10 * loop.YOUNG_GC_THRESHOLD, 5, 5))
    loop.freeze_heap_once()
    assert recorded == ["collect", "freeze"]
