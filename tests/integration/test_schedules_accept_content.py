"""Schedules and the app's ``accept_content`` on a real PostgreSQL: a schedule
its workers would refuse is refused before anything is written (add,
add_many, update, the code's static schedules), and a stored schedule whose
arguments cannot be decoded shows as broken in every listing (the client,
``sched schedules``, ``sched export``, the console) instead of failing it."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from celery import Celery
from starlette.testclient import TestClient

from celery_sched.client import Client
from celery_sched.errors import InvalidSchedule
from celery_sched.leader.planning import Planner
from celery_sched.schedules import spec_from_entry
from celery_sched.settings import Settings
from celery_sched.web.app import create_app
from tests.integration import cli_app
from tests.integration.test_cli_schedules import one_line_error, sched

pytestmark = pytest.mark.integration


def pickle_app(*, accepted: bool) -> Celery:
    """An app that serializes with pickle; its workers accept it or not."""
    app = Celery("pickling", broker="memory://", set_as_current=False)
    accept = ["json", "pickle"] if accepted else ["json"]
    app.conf.update(timezone="UTC", task_serializer="pickle", accept_content=accept)
    return app


@pytest.fixture
def client(pg_url: str, pg_schema: str) -> Iterator[Client]:
    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        yield client


@pytest.fixture
def refusing(client: Client) -> Iterator[Client]:
    """A client of the same schema whose app pickles what it does not accept."""
    with Client(pickle_app(accepted=False), settings=client.settings, staging=False) as other:
        yield other


def test_a_schedule_its_workers_would_refuse_is_refused_before_writing(
    client: Client, refusing: Client
) -> None:
    needles = ("'pickle'", "accept_content", "json")
    with pytest.raises(InvalidSchedule) as raised:
        refusing.schedules.add("nightly", "cli_app.ping", 60.0, check_task=False)
    for needle in needles:
        assert needle in str(raised.value)
    entry = {"name": "bulk", "task": "cli_app.ping", "schedule": 60.0}
    with pytest.raises(InvalidSchedule, match="accept_content"):
        refusing.schedules.add_many([entry], check_task=False)
    with pytest.raises(InvalidSchedule, match="accept_content"):
        refusing.schedules.check(entry, check_task=False)
    assert client.store.list_schedules() == []

    # An update through such a client is refused too, and leaves the row as it was.
    client.schedules.add("kept", "cli_app.ping", 60.0, args=(1,))
    with pytest.raises(InvalidSchedule, match="accept_content"):
        refusing.schedules.update("kept", args=(2,), check_task=False)
    kept = client.schedules.get("kept")
    assert kept is not None and kept.args == (1,) and kept.state == "active"


def test_a_static_schedule_its_workers_would_refuse_is_logged_and_skipped(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    app = pickle_app(accepted=False)
    app.conf.beat_schedule = {"bad": {"task": "cli_app.ping", "schedule": 60.0}}
    static = [spec_from_entry("bad", app.conf.beat_schedule["bad"], app=app)]
    planner = Planner(client.store, client.settings, app=app, static=static)
    with caplog.at_level(logging.ERROR, logger="celery_sched.leader.planning"):
        planner.sync_static()
    assert client.store.list_schedules() == []
    assert "static schedule 'bad' not synced" in caplog.text and "accept_content" in caplog.text


def test_listings_show_a_schedule_they_cannot_decode_as_broken(
    client: Client, pg_url: str, pg_schema: str
) -> None:
    # Stored by a client whose app accepted pickle (or before this check).
    with Client(pickle_app(accepted=True), settings=client.settings, staging=False) as other:
        other.schedules.add("legacy", "cli_app.ping", 60.0, args=(1,), check_task=False)
    client.schedules.add("fine", "cli_app.ping", 60.0)

    infos = {info.name: info for info in client.schedules.list()}
    legacy = infos["legacy"]
    assert legacy.state == "broken" and infos["fine"].state == "active"
    assert legacy.undecodable is not None and "accept_content" in legacy.undecodable
    assert legacy.broken_reason == legacy.undecodable
    assert legacy.args == () and legacy.kwargs == {}
    got = client.schedules.get("legacy")
    assert got is not None and got.state == "broken"
    assert client.schedules.pause("legacy").paused  # steering still works

    run = dict(schema=pg_schema, database_url=pg_url)
    result = sched("schedules", **run)
    assert result.returncode == 0, result.stderr
    assert "legacy" in result.stdout and "accept_content" in result.stdout
    result = sched("schedules", "--json", **run)
    assert result.returncode == 0, result.stderr
    # Its arguments are unreadable here: an export would lose them, so it refuses.
    one_line_error(sched("export", **run), "legacy", "accept_content")

    web = TestClient(create_app(client), base_url="http://127.0.0.1")
    page = web.get("/schedules", params={"format": "json"})
    assert page.status_code == 200, page.text
    rows = {row["name"]: row for row in page.json()["schedules"]}
    assert rows["legacy"]["state"] == "broken"
    assert "accept_content" in rows["legacy"]["broken_reason"]
    assert web.get("/schedules").status_code == 200
    assert web.get("/schedules/legacy").status_code == 200
