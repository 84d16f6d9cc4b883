"""The fast publish setting and the version gate of ``fast_path.choose``
(the choice on real brokers: tests/integration/test_fast_publish.py)."""

from __future__ import annotations

import importlib.metadata

import pytest

from celery_sched.dispatch import fast_path
from celery_sched.errors import ConfigurationError
from celery_sched.settings import Settings


def test_fast_publish_defaults_to_auto_and_accepts_off() -> None:
    assert Settings().fast_publish == "auto"
    assert Settings.from_mapping({"celery_sched_fast_publish": "off"}, {}).fast_publish == "off"
    assert Settings.from_mapping({}, {"CELERY_SCHED_FAST_PUBLISH": "off"}).fast_publish == "off"


@pytest.mark.parametrize("value", ["on", "", "OFF", "true", "kombu"])
def test_other_fast_publish_values_are_refused(value: str) -> None:
    message = f"celery_sched_fast_publish must be 'auto' or 'off', got {value!r}"
    with pytest.raises(ConfigurationError) as caught:
        Settings.from_mapping({"celery_sched_fast_publish": value}, {})
    assert str(caught.value) == message
    with pytest.raises(ConfigurationError):
        Settings(fast_publish=value)


@pytest.mark.parametrize(
    ("version", "numbers"),
    [
        ("5.7.0", (5, 7, 0)),
        ("5.4.2", (5, 4, 2)),
        ("5.7.0.post1", (5, 7, 0)),
        ("6", (6,)),
        ("5.8.0rc1", None),
        ("5.7.0.dev3", None),
        ("5.7.0+local", None),
    ],
)
def test_release_numbers(version: str, numbers: tuple[int, ...] | None) -> None:
    assert fast_path.release(version) == numbers


def test_the_installed_kombu_and_amqp_are_in_the_tested_ranges() -> None:
    """The ranges name what this environment runs; widen them with care."""
    assert fast_path.untested_version("kombu", fast_path.TESTED_KOMBU) == ""
    assert fast_path.untested_version("amqp", fast_path.TESTED_AMQP) == ""


@pytest.mark.parametrize(
    ("installed", "why"),
    [
        ("5.6.9", "kombu 5.6.9 is outside the tested range >=5.7.0,<5.8"),
        ("5.8.0", "kombu 5.8.0 is outside the tested range >=5.7.0,<5.8"),
        ("5.7.1rc1", "kombu 5.7.1rc1 is outside the tested range >=5.7.0,<5.8"),
        ("5.7.0", ""),
        ("5.7.12", ""),
    ],
)
def test_versions_outside_the_range_are_untested(
    installed: str, why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    assert fast_path.untested_version("kombu", ((5, 7, 0), (5, 8))) == why
