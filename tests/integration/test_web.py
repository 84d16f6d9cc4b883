"""The web console over a real PostgreSQL and Redis: every page with data and
empty, every action as the API does it, bad input shown and not written,
CSRF, auth and Host refusals, the security headers, and ``sched web``'s bind
check and ``--allowed-host`` as a real process."""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from starlette.testclient import TestClient

from celery_sched.client import Client
from celery_sched.models import JobStatus
from celery_sched.settings import Settings
from celery_sched.web.app import Credentials, create_app
from tests.e2e.harness import CELERY, ROOT, settings_env
from tests.integration import cli_app
from tests.integration.test_cli_jobs import make_dead

pytestmark = pytest.mark.integration

BASE = dt.datetime(2031, 5, 1, 10, 0, tzinfo=dt.UTC)
PAGES = ["/", "/schedules", "/jobs"]


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    with Client(cli_app.app, settings=settings) as client:
        client.migrate()
        yield client


#: The console serves the loopback names only, unless told others.
LOCAL = "http://localhost"


@pytest.fixture
def web(client: Client) -> TestClient:
    return TestClient(create_app(client), base_url=LOCAL)


def csrf_of(web: TestClient, path: str = "/schedules") -> str:
    page = web.get(path)
    assert page.status_code == 200, page.text
    match = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert match is not None, "the page has no CSRF field"
    return match.group(1)


def seed(client: Client) -> None:
    client.schedules.add(
        "nightly <b>", task="cli_app.ping", schedule="0 7 * * 1-5", timezone="Europe/Paris"
    )
    client.schedules.add("every-minute", task="cli_app.ping", schedule=60.0)
    client.schedule_many(
        {"task": "cli_app.ping", "eta": BASE + dt.timedelta(minutes=i), "key": f"order/{i:03d}"}
        for i in range(120)
    )
    make_dead(client, ["dead-1", "dead-2"])


def test_recent_failures_list_the_latest_to_finish_first(client: Client, web: TestClient) -> None:
    make_dead(client, ["dead-1", "dead-2"])
    # Due before the dead jobs, failed after them: first on the overview.
    client.schedule_many(
        [{"task": "cli_app.ping", "eta": client.store.now() - dt.timedelta(hours=2), "key": "late"}]
    )
    job = client.store.get("late")
    assert job is not None
    assert client.store.mark_running(job.id, worker="w@test")
    assert client.store.mark_finished(job.id, JobStatus.FAILED, error="boom")
    failures = web.get("/", params={"format": "json"}).json()["failures"]
    assert len(failures) == 3 and failures[0]["key"] == "late"
    assert {row["key"] for row in failures[1:]} == {"dead-1", "dead-2"}
    assert failures[0]["last_error"] == "boom"


@pytest.mark.parametrize("path", PAGES)
def test_every_page_answers_on_an_empty_database(web: TestClient, path: str) -> None:
    html = web.get(path)
    assert html.status_code == 200, html.text
    assert "celery_sched" in html.text
    data = web.get(path, params={"format": "json"})
    assert data.status_code == 200
    assert data.headers["content-type"] == "application/json"
    assert isinstance(data.json(), dict)


def test_every_page_shows_the_data(client: Client, web: TestClient) -> None:
    seed(client)
    overview = web.get("/", params={"format": "json"}).json()
    assert overview["counts"]["pending"] >= 120
    assert overview["counts"]["dead"] == 2
    assert {job["key"] for job in overview["failures"]} == {"dead-1", "dead-2"}
    # The chart: two jobs dispatched about 10 minutes after they were due,
    # in the same due minute of the last hour (the dead jobs' dispatch was
    # undone when they were given up on).
    due = (client.store.now() - dt.timedelta(minutes=10)).replace(second=5, microsecond=0)
    client.schedule_many(
        {"task": "cli_app.ping", "eta": due + dt.timedelta(seconds=i), "key": f"sent-{i}"}
        for i in range(2)
    )
    epoch = client.store.acquire_epoch(0, "test leader")
    assert len(client.store.claim_due(shard=0, epoch=epoch, limit=10)) == 2
    per_minute = web.get("/", params={"format": "json"}).json()["per_minute"]
    assert len(per_minute) == 61
    sent = [(count, lag) for _, count, lag in per_minute if count]
    assert len(sent) == 1 and sent[0][0] == 2 and 590 < sent[0][1] < 700, sent
    assert len(overview["leaders"]) == client.settings.shards
    assert "<svg" in web.get("/").text

    schedules = web.get("/schedules", params={"format": "json"}).json()["schedules"]
    words = {s["name"]: s["words"] for s in schedules}
    assert words == {
        "every-minute": "every minute",
        "nightly <b>": "at 07:00 on weekdays, Europe/Paris",
    }
    html = web.get("/schedules").text
    # A name a user typed is escaped, never markup.
    assert "nightly &lt;b&gt;" in html and "nightly <b>" not in html

    detail = web.get("/schedules/nightly <b>", params={"format": "json"}).json()
    assert detail["schedule"]["name"] == "nightly <b>"
    assert web.get("/schedules/nope").status_code == 404

    page = web.get("/jobs", params={"prefix": "order/", "format": "json"}).json()
    assert len(page["jobs"]) == 50 and page["next"]
    keys = [job["key"] for job in page["jobs"]]
    while page["next"]:
        page = web.get(
            "/jobs", params={"prefix": "order/", "after": page["next"], "format": "json"}
        ).json()
        keys += [job["key"] for job in page["jobs"]]
    assert keys == [f"order/{i:03d}" for i in range(120)]

    window = web.get(
        "/jobs",
        params={
            "due_after": "2031-05-01T10:10",
            "due_before": "2031-05-01T10:12",
            "format": "json",
        },
    ).json()
    assert [job["key"] for job in window["jobs"]] == ["order/010", "order/011"]
    dead = web.get("/jobs", params={"status": "dead", "task": "cli_app.ping", "format": "json"})
    assert {job["key"] for job in dead.json()["jobs"]} == {"dead-1", "dead-2"}

    job = web.get("/jobs/order/005", params={"format": "json"}).json()
    assert job["job"]["key"] == "order/005" and job["cancellable"]
    assert "task" in job["headers"] or "id" in job["headers"]
    assert web.get("/jobs/no-such-key").status_code == 404


def test_bad_filters_are_one_line_errors(web: TestClient) -> None:
    bad_time = web.get("/jobs", params={"due_after": "yesterday"})
    assert bad_time.status_code == 400 and "not an ISO 8601 time" in bad_time.text
    assert web.get("/jobs", params={"status": "nope"}).status_code == 400
    assert web.get("/jobs", params={"after": "garbage!!"}).status_code == 400


def test_schedule_actions_change_the_database_as_the_api(client: Client, web: TestClient) -> None:
    seed(client)
    token = csrf_of(web)
    name = "nightly <b>"
    assert web.post("/actions/pause", data={"csrf": token, "name": name}).status_code == 200
    info = client.schedules.get(name)
    assert info is not None and info.paused
    web.post("/actions/resume", data={"csrf": token, "name": name})
    info = client.schedules.get(name)
    assert info is not None and not info.paused

    triggered = web.post("/actions/trigger", data={"csrf": token, "name": name})
    assert triggered.status_code == 200
    history = client.schedules.history(name)
    assert len(history) == 1 and history[0].status is JobStatus.PENDING

    edited = web.post(
        "/actions/edit",
        data={
            "csrf": token,
            "name": name,
            "schedule": "30 8 * * *",
            "timezone": "UTC",
            "misfire": "skip",
            "overlap": "skip",
        },
    )
    assert edited.status_code == 200, edited.text
    info = client.schedules.get(name)
    assert info is not None
    assert (info.spec["minute"], info.spec["hour"], info.timezone) == ("30", "8", "UTC")
    assert (info.misfire, info.overlap) == ("skip", "skip")

    # "(default)" puts the misfire policy back to the project's default (NULL).
    reset = web.post(
        "/actions/edit",
        data={"csrf": token, "name": name, "misfire": "", "overlap": "allow"},
    )
    assert reset.status_code == 200, reset.text
    info = client.schedules.get(name)
    assert info is not None
    assert (info.misfire, info.overlap, info.timezone) == (None, "allow", "UTC")
    row = client.store.get_schedule(name)
    assert row is not None and row.misfire is None

    kept = web.post("/actions/delete", data={"csrf": token, "name": name, "confirm": "wrong"})
    assert kept.status_code == 400 and client.schedules.get(name) is not None
    web.post("/actions/delete", data={"csrf": token, "name": name, "confirm": name})
    assert client.schedules.get(name) is None


def test_a_bad_edit_is_shown_next_to_its_field_and_writes_nothing(
    client: Client, web: TestClient
) -> None:
    seed(client)
    before = client.schedules.get("nightly <b>")
    token = csrf_of(web)
    answer = web.post(
        "/actions/edit",
        data={
            "csrf": token,
            "name": "nightly <b>",
            "schedule": "61 * * * *",
            "timezone": "Mars/Olympus",
        },
    )
    assert answer.status_code == 400
    assert re.search(r'id="error-schedule">[^<]*61', answer.text), answer.text
    assert 'id="error-timezone"' in answer.text
    # What the user typed is shown back in the field, escaped.
    assert 'value="61 * * * *"' in answer.text
    assert client.schedules.get("nightly <b>") == before


def test_job_actions_change_the_database_as_the_api(client: Client, web: TestClient) -> None:
    seed(client)
    token = csrf_of(web, "/jobs")
    assert web.post("/actions/cancel", data={"csrf": token, "key": "order/001"}).status_code == 200
    job = client.get("order/001")
    assert job is not None and job.status is JobStatus.CANCELLED
    again = web.post("/actions/cancel", data={"csrf": token, "key": "order/001"})
    assert again.status_code == 400 and "no longer pending" in again.text

    web.post("/actions/requeue", data={"csrf": token, "key": "dead-1"})
    job = client.get("dead-1")
    assert job is not None and job.status is JobStatus.PENDING and job.attempt == 2
    refused = web.post("/actions/requeue", data={"csrf": token, "key": "order/002"})
    assert refused.status_code == 400
    job = client.get("order/002")
    assert job is not None and job.status is JobStatus.PENDING and job.attempt == 0

    other = web.post("/actions/requeue-dead", data={"csrf": token, "task": "other.task"})
    assert other.status_code == 200
    job = client.get("dead-2")
    assert job is not None and job.status is JobStatus.DEAD
    web.post("/actions/requeue-dead", data={"csrf": token, "task": "cli_app.ping"})
    job = client.get("dead-2")
    assert job is not None and job.status is JobStatus.PENDING


def test_a_post_without_the_csrf_token_is_refused_and_writes_nothing(
    client: Client, web: TestClient
) -> None:
    seed(client)
    csrf_of(web)  # the cookie is set; the form field is what is missing
    assert web.post("/actions/pause", data={"name": "every-minute"}).status_code == 403
    assert (
        web.post("/actions/pause", data={"name": "every-minute", "csrf": "forged"}).status_code
        == 403
    )
    fresh = TestClient(create_app(client), base_url=LOCAL)  # no cookie at all
    assert fresh.post("/actions/cancel", data={"key": "order/001", "csrf": "x"}).status_code == 403
    info = client.schedules.get("every-minute")
    job = client.get("order/001")
    assert info is not None and not info.paused
    assert job is not None and job.status is JobStatus.PENDING


def test_auth_is_asked_and_checked(client: Client) -> None:
    web = TestClient(create_app(client, auth=Credentials.parse("admin:s3cret")), base_url=LOCAL)
    assert web.get("/").status_code == 401
    wrong = base64.b64encode(b"admin:nope").decode()
    assert web.get("/", headers={"Authorization": f"Basic {wrong}"}).status_code == 401
    right = base64.b64encode(b"admin:s3cret").decode()
    assert web.get("/", headers={"Authorization": f"Basic {right}"}).status_code == 200


#: Host headers a DNS-rebinding page (or a misrouted request) arrives with.
FORGED_HOSTS = [
    "evil.example",
    "evil.example:8808",
    "localhost.evil.example",
    "127.0.0.1.nip.io:8808",
    "localhost:8808.evil.example",
    "[::1].evil.example",
    "",
]


@pytest.mark.parametrize("host", FORGED_HOSTS)
def test_a_forged_host_is_refused_and_writes_nothing(
    client: Client, web: TestClient, host: str
) -> None:
    seed(client)
    before = {key: client.get(key) for key in ("dead-1", "dead-2", "order/001")}
    # The cookie and token of a real visit, sent along: the Host alone refuses.
    token = csrf_of(web, "/jobs")
    forged = {"Host": host}
    for path in ["/", "/schedules", "/jobs?status=dead&format=json", "/jobs/dead-1"]:
        answer = web.get(path, headers=forged)
        assert answer.status_code == 400, (path, answer.status_code)
        assert answer.headers["content-type"].startswith("text/plain")
        assert answer.text == "invalid Host header\n"
    actions = [
        ("requeue", {"key": "dead-1"}),
        ("requeue-dead", {"task": "cli_app.ping"}),
        ("cancel", {"key": "order/001"}),
        ("pause", {"name": "every-minute"}),
    ]
    for op, fields in actions:
        answer = web.post(f"/actions/{op}", data={"csrf": token, **fields}, headers=forged)
        assert answer.status_code == 400, (op, answer.status_code)
    assert {key: client.get(key) for key in before} == before
    info = client.schedules.get("every-minute")
    assert info is not None and not info.paused


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:8808",
        "LocalHost",
        "127.0.0.1",
        "127.0.0.1:18808",
        "[::1]",
        "[::1]:80",
    ],
)
def test_the_loopback_names_are_served(client: Client, web: TestClient, host: str) -> None:
    seed(client)
    token = csrf_of(web)
    assert web.get("/schedules", headers={"Host": host}).status_code == 200
    paused = web.post(
        "/actions/pause",
        data={"csrf": token, "name": "every-minute"},
        headers={"Host": host},
        follow_redirects=False,
    )
    assert paused.status_code == 303
    info = client.schedules.get("every-minute")
    assert info is not None and info.paused


def test_allowed_hosts_are_served_and_no_others(client: Client) -> None:
    app = create_app(client, allowed_hosts=["console.example.com", "10.0.0.5:8808"])
    web = TestClient(app, base_url=LOCAL)
    for host in [
        "console.example.com",
        "console.example.com:443",
        "Console.Example.COM",
        "10.0.0.5:8808",
        "localhost",
    ]:
        assert web.get("/schedules", headers={"Host": host}).status_code == 200, host
    for host in ["10.0.0.5", "10.0.0.5:9000", "example.com", "evil.console.example.com"]:
        assert web.get("/schedules", headers={"Host": host}).status_code == 400, host


def csp_of(answer: httpx.Response) -> dict[str, str]:
    policy = answer.headers.get("content-security-policy", "")
    directives = (part.strip().split(None, 1) for part in policy.split(";") if part.strip())
    return {words[0]: words[1] if len(words) > 1 else "" for words in directives}


def test_every_response_carries_the_security_headers(client: Client) -> None:
    seed(client)
    user = ("admin", "s3cret")
    web = TestClient(create_app(client, auth=Credentials.parse("admin:s3cret")), base_url=LOCAL)
    page = web.get("/", auth=user)
    answers = {
        "page": page,
        "json": web.get("/jobs", params={"format": "json"}, auth=user),
        "401": web.get("/"),
        "404 job": web.get("/jobs/no-such-key", auth=user),
        "404 route": web.get("/no/such/page", auth=user),
        "403 csrf": web.post("/actions/pause", data={"name": "every-minute"}, auth=user),
        "400 host": web.get("/", headers={"Host": "evil.example"}),
        "405": web.post("/jobs", auth=user),
    }
    for what, answer in answers.items():
        assert answer.headers.get("x-frame-options") == "DENY", what
        assert answer.headers.get("x-content-type-options") == "nosniff", what
        csp = csp_of(answer)
        assert csp.get("default-src") == "'none'", (what, csp)
        assert csp.get("frame-ancestors") == "'none'", (what, csp)
        assert csp.get("form-action") == "'self'", (what, csp)
        assert csp.get("base-uri") == "'none'", (what, csp)
        assert "unsafe" not in answer.headers["content-security-policy"], what
    assert answers["page"].status_code == 200 and answers["401"].status_code == 401
    assert answers["400 host"].status_code == 400 and answers["405"].status_code == 405

    # What the policy allows is what the pages use: a stylesheet of the
    # console's own, inline SVG, forms posting to the console; no inline
    # style or script, no javascript: link.
    match = re.search(r'<link rel="stylesheet" href="(/[^"]+)">', page.text)
    assert match is not None, "the page links no stylesheet"
    css = web.get(match.group(1), auth=user)
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert "header" in css.text
    assert csp_of(page).get("style-src") == "'self'"
    pages = [
        page,
        web.get("/schedules", auth=user),
        web.get("/schedules/every-minute", auth=user),
        web.get("/jobs", auth=user),
        web.get("/jobs/dead-1", auth=user),
        answers["404 job"],
    ]
    for html in pages:
        found = re.search(r"<style|<script|\sstyle=|\son[a-z]+=|javascript:", html.text, re.I)
        assert found is None, (found, html.url)


def _sched_web(
    settings: Settings, *args: str, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **settings_env(settings), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [CELERY, "-A", "tests.integration.cli_app", "sched", "web", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_non_loopback_bind_without_auth_is_refused(settings: Settings) -> None:
    result = _sched_web(settings, "--bind", "0.0.0.0:18808")
    assert result.returncode == 1
    assert "needs --auth" in result.stderr
    assert "Traceback" not in result.stderr


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_non_loopback_bind_with_auth_answers_401_without_it(settings: Settings) -> None:
    import httpx

    from tests.e2e.harness import wait_for

    with Client(cli_app.app, settings=settings) as client:
        client.migrate()
    port = _free_port()
    env = {**os.environ, **settings_env(settings), "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [
            CELERY,
            "-A",
            "tests.integration.cli_app",
            "sched",
            "web",
            "--bind",
            f"0.0.0.0:{port}",
            "--auth",
            "ops:hunter2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def up() -> bool:
            try:
                httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            except httpx.TransportError:
                return False
            return True

        wait_for(up, timeout=30, what="the console to listen")
        assert httpx.get(f"http://127.0.0.1:{port}/").status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/schedules", auth=("ops", "hunter2"))
        assert ok.status_code == 200 and "Schedules" in ok.text
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_a_missing_schema_is_a_one_line_503(settings: Settings) -> None:
    with Client(cli_app.app, settings=settings) as client:  # never migrated
        web = TestClient(create_app(client), base_url=LOCAL)
        for path in PAGES:
            answer = web.get(path)
            assert answer.status_code == 503, path
            assert "sched migrate" in answer.text and "Traceback" not in answer.text


def _serve(
    settings: Settings, *args: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """A real ``sched web`` process; the caller ends it."""
    return subprocess.Popen(
        [CELERY, "-A", "tests.integration.cli_app", "sched", "web", *args],
        cwd=ROOT,
        env={**os.environ, **settings_env(settings), "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _status(url: str, host: str) -> int | None:
    try:
        return httpx.get(url, headers={"Host": host}, timeout=2).status_code
    except httpx.TransportError:
        return None


@pytest.mark.parametrize("how", ["option", "setting"])
def test_sched_web_serves_its_bound_address_and_the_allowed_hosts(
    settings: Settings, how: str
) -> None:
    from tests.e2e.harness import wait_for

    with Client(cli_app.app, settings=settings) as client:
        client.migrate()
    port = _free_port()
    # 127.0.0.2 is loopback but none of the loopback names: it is served
    # because the console is bound to it.
    url = f"http://127.0.0.2:{port}/schedules"
    if how == "option":
        args = ["--allowed-host", "console.example.com", "--allowed-host", "ops.example.com"]
        env = {}
    else:
        args = []
        env = {"CELERY_SCHED_WEB_ALLOWED_HOSTS": "console.example.com, ops.example.com"}
    server = _serve(settings, "--bind", f"127.0.0.2:{port}", *args, env=env)
    try:
        wait_for(
            lambda: _status(url, f"127.0.0.2:{port}") is not None,
            timeout=30,
            what="the console to listen",
        )
        for host in [
            f"127.0.0.2:{port}",
            "console.example.com",
            "ops.example.com:8443",
            "localhost",
        ]:
            assert _status(url, host) == 200, host
        for host in ["evil.example", f"evil.example:{port}", "example.com"]:
            assert _status(url, host) == 400, host
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.mark.parametrize("value", ["http://console.example.com/", "a b", "x:port", ""])
def test_a_bad_allowed_host_is_a_one_line_error(settings: Settings, value: str) -> None:
    result = _sched_web(settings, "--bind", f"127.0.0.1:{_free_port()}", "--allowed-host", value)
    assert result.returncode != 0
    assert "allowed host" in result.stderr and repr(value) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
