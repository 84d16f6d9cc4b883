"""The web console's pure parts: schedules in words, the SVG chart, HTTP
Basic credentials and the bind check."""

from __future__ import annotations

import base64
import datetime as dt

import pytest

from celery_sched.errors import ConfigurationError
from celery_sched.web.app import AllowedHosts, Credentials, check_bind, is_loopback
from celery_sched.web.words import bar_chart, schedule_words


@pytest.mark.parametrize(
    ("kind", "spec", "words"),
    [
        (
            "crontab",
            {"minute": "0", "hour": "7", "day_of_week": "1-5"},
            "at 07:00 on weekdays, UTC",
        ),
        ("crontab", {"minute": "30", "hour": "23"}, "at 23:30 every day, UTC"),
        ("crontab", {"minute": "15", "hour": "*"}, "at minute 15 of every hour, UTC"),
        ("crontab", {"minute": "*/5"}, "every 5 minutes, UTC"),
        ("crontab", {"minute": "0", "hour": "7", "day_of_month": "1"}, "cron 0 7 1 * *, UTC"),
        ("interval", {"seconds": 60.0}, "every minute"),
        ("interval", {"seconds": 7200.0}, "every 2 hours"),
        ("interval", {"seconds": 90.0}, "every 90 seconds"),
    ],
)
def test_schedules_in_words(kind: str, spec: dict[str, str], words: str) -> None:
    assert schedule_words(kind, spec, "UTC") == words


def test_the_chart_escapes_and_scales() -> None:
    at = dt.datetime(2031, 5, 1, 10, tzinfo=dt.UTC)
    svg = bar_chart([(at, 1.0), (at + dt.timedelta(minutes=1), 4.0)], unit="<s>", title="a&b")
    assert svg.count("<rect") == 2
    assert "<s>" not in svg and "&lt;s&gt;" in svg and "a&amp;b" in svg
    assert "no data" in bar_chart([], title="empty")


def _basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


def test_credentials() -> None:
    creds = Credentials.parse("ops:pa:ss")
    assert (creds.user, creds.password) == ("ops", "pa:ss")
    assert creds.accepts(_basic("ops:pa:ss"))
    for wrong in (None, "", _basic("ops:pa"), _basic("op:pa:ss"), "Bearer x", "Basic !!!"):
        assert not creds.accepts(wrong)
    for bad in ("ops", ":x", "ops:"):
        with pytest.raises(ConfigurationError, match="user:password"):
            Credentials.parse(bad)


def test_only_loopback_may_go_without_auth() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    assert not is_loopback("example.org")
    check_bind("127.0.0.1", auth=None, insecure=False)
    check_bind("0.0.0.0", auth=Credentials.parse("a:b"), insecure=False)
    check_bind("0.0.0.0", auth=None, insecure=True)
    with pytest.raises(ConfigurationError, match="needs --auth"):
        check_bind("0.0.0.0", auth=None, insecure=False)


def test_allowed_hosts_are_the_loopback_names_the_bind_and_those_given() -> None:
    default = AllowedHosts.of([])
    for host in ("localhost", "LOCALHOST:8808", "127.0.0.1", "127.0.0.1:1", "[::1]", "[::1]:8808"):
        assert default.allow(host), host
    for host in (
        "",
        " ",
        "evil.example",
        "127.0.0.2",
        "localhost:",
        "localhost:0",
        "localhost:65536",
        "localhost:80:80",
        "localhost:8808.evil.example",
        "[::1].evil.example",
        "[::1",
        "local host",
        "localhost/",
    ):
        assert not default.allow(host), host

    given = AllowedHosts.of(["Console.Example.com", "10.0.0.5:8808", "fe80::1"], bind="10.0.0.9")
    for host in ("console.example.com:443", "10.0.0.5:8808", "[fe80::1]:80", "10.0.0.9:8808"):
        assert given.allow(host), host
    for host in ("10.0.0.5", "10.0.0.5:8809", "www.console.example.com"):
        assert not given.allow(host), host
    # Every interface is no name a client uses.
    assert AllowedHosts.of([], bind="0.0.0.0").names == AllowedHosts.of([]).names
    assert AllowedHosts.of([], bind="::").names == AllowedHosts.of([]).names
    assert AllowedHosts.of([], bind="::1").allow("[::1]:8808")


@pytest.mark.parametrize("bad", ["", "http://console.example.com/", "a b", "x:port", "[::1", "h:0"])
def test_a_bad_allowed_host_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ConfigurationError, match="allowed host") as info:
        AllowedHosts.of(["ok.example.com", bad])
    assert repr(bad) in str(info.value)
