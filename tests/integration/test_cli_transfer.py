"""``sched import`` / ``sched export`` as real subprocesses: job files, the
export round trip, and real celery-redbeat entries (Redis) and
django-celery-beat tables (created by its Django migrations) to move from."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from celery import Celery
from celery.schedules import crontab, schedule, solar

from celery_sched.client import Client
from celery_sched.models import JobStatus
from celery_sched.schedules import clocked
from celery_sched.settings import Settings
from tests.e2e import harness
from tests.integration import cli_app
from tests.integration.test_cli_schedules import ROOT, one_line_error, sched

pytestmark = pytest.mark.integration


@pytest.fixture
def client(pg_url: str, pg_schema: str) -> Iterator[Client]:
    settings = Settings(database_url=pg_url, db_schema=pg_schema)
    with Client(cli_app.app, settings=settings, staging=False) as client:
        client.migrate()
        yield client


def test_import_csv_refuses_bad_rows_by_line_and_writes_the_good_ones(
    client: Client, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    path = tmp_path / "jobs.csv"
    path.write_text(
        "task,key,due,args,kwargs,queue,priority,countdown,expires\n"
        'cli_app.ping,a,2031-05-01T10:00:00Z,"[1, ""x""]","{""k"": 2}",reports,7,,60\n'
        "nope.task,b,2031-05-01T10:00:00Z,,,,,,\n"
        "cli_app.ping,c,not-a-time,,,,,,\n"
        'cli_app.ping,d,,"[1,",,,,,\n'
        "cli_app.ping,e,,,,,high,,\n"
        "cli_app.ping,a,2031-05-01T11:00:00Z,,,,,,\n"
        "cli_app.ping,f,,,,,,30,\n"
        "cli_app.ping,g,2031-05-01T12:00:00+02:00,,,,,,\n"
    )
    run = dict(schema=pg_schema, database_url=pg_url)
    result = sched("import", str(path), "--dry-run", **run)
    assert result.returncode == 1, result.stderr
    assert "Dry run: read 8 row(s): 3 valid, 5 refused; nothing written." in result.stdout
    assert client.counts_by_status() == {}

    result = sched("import", str(path), "--chunk-size", "2", **run)
    one_line_error(result, "5 row(s) refused")
    out = result.stdout
    assert "Read 8 row(s): 3 valid, 3 written, 5 refused." in out
    assert "line 3: UnknownTask: task 'nope.task' is not registered" in out
    assert "line 4: InvalidTime: eta is not an ISO 8601 datetime: 'not-a-time'" in out
    assert "line 5: column args: malformed JSON" in out
    assert "line 6: column priority: not an integer: 'high'" in out
    assert "line 7: key 'a' is already on line 2" in out

    job = client.get("a")
    assert job is not None
    assert job.due_at == dt.datetime(2031, 5, 1, 10, tzinfo=dt.UTC)
    assert client.decode(job) == ((1, "x"), {"k": 2})
    assert job.options["queue"] == "reports" and job.options["priority"] == 7
    assert job.expires_at == job.due_at + dt.timedelta(seconds=60)
    later = client.get("g")
    assert later is not None and later.due_at == dt.datetime(2031, 5, 1, 10, tzinfo=dt.UTC)
    soon = client.get("f")
    assert soon is not None
    assert 20 < (soon.due_at - client.store.now()).total_seconds() <= 30
    assert client.counts_by_status() == {JobStatus.PENDING: 3}


def test_import_jsonl_from_stdin_writes_chunks_all_or_nothing(
    client: Client, pg_url: str, pg_schema: str
) -> None:
    client.schedule("cli_app.ping", key="taken", eta=dt.datetime(2031, 1, 1, tzinfo=dt.UTC))
    rows = [
        {"task": "cli_app.ping", "key": "j1", "eta": "2031-02-01T00:00:00Z", "args": [1]},
        {"task": "cli_app.ping", "key": "taken", "eta": "2031-02-01T00:00:00Z"},
        {"task": "cli_app.ping", "key": "j3", "due": "2031-02-01T00:00:00Z", "queue": "q"},
    ]
    text = "\n".join(json.dumps(row) for row in rows) + "\n\n{not json\n[1]\n"
    run = dict(schema=pg_schema, database_url=pg_url)
    one_line_error(sched("import", "-", stdin=text, **run), "--format")

    result = sched("import", "-", "--format", "jsonl", "--chunk-size", "2", stdin=text, **run)
    one_line_error(result, "2 row(s) refused and 1 chunk(s) not written")
    assert "Read 5 row(s): 3 valid, 1 written, 2 refused." in result.stdout
    assert "line 5: malformed JSON" in result.stdout
    assert "line 6: expected a JSON object, got list" in result.stdout
    assert "lines 1-2 (2 row(s)): DuplicateJob" in result.stdout
    assert client.get("j1") is None  # its chunk held the stored key
    job = client.get("j3")
    assert job is not None and job.options["queue"] == "q"


@pytest.mark.parametrize(
    ("name", "content", "extra", "needles"),
    [
        ("missing.csv", None, (), ("cannot open", "missing.csv")),
        ("jobs.txt", "task\n", (), ("cannot tell the format", ".csv")),
        ("empty.csv", "", (), ("empty", "header")),
        ("cols.csv", "task,when\ncli_app.ping,x\n", (), ("unknown column", "'when'")),
        ("notask.csv", "key\nk1\n", (), ("no 'task' column",)),
        ("latin.csv", b"task,key\ncli_app.ping,caf\xe9\n", (), ("not UTF-8",)),
        ("x.jsonl", "{}\n", ("--from", "redbeat"), ("reads no FILE",)),
    ],
)
def test_import_bad_input_is_one_line_and_writes_nothing(
    client: Client,
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    name: str,
    content: str | bytes | None,
    extra: tuple[str, ...],
    needles: tuple[str, ...],
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    result = sched("import", str(path), *extra, schema=pg_schema, database_url=pg_url)
    assert result.returncode != 0
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert client.counts_by_status() == {}


def test_export_delete_import_round_trip(
    client: Client, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    add = client.schedules.add
    add("cron-paris", "cli_app.ping", crontab(minute="30", hour="2", day_of_week="mon-fri"),
        timezone="Europe/Paris", args=(1, "two"), kwargs={"k": [3]}, queue="reports",
        priority=5, expires=120, misfire="skip", overlap="skip")  # fmt: skip
    add("every-90s", "cli_app.ping", schedule(dt.timedelta(seconds=90)), relative=True,
        catchup_window=600, max_catchup=3)  # fmt: skip
    add("last-day", "cli_app.ping", "0 18 L * *")
    add("dawn", "cli_app.ping", solar("sunrise", 48.85, 2.35))
    add("once", "cli_app.ping", clocked(dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=dt.UTC)))
    client.schedules.pause("every-90s")
    run = dict(schema=pg_schema, database_url=pg_url)

    exported = tmp_path / "schedules.jsonl"
    result = sched("export", str(exported), **run)
    assert result.returncode == 0, result.stderr
    assert "Exported 5 schedule(s)" in result.stderr
    before = exported.read_text()
    rows = [json.loads(line) for line in before.splitlines()]
    assert [row["name"] for row in rows] == ["cron-paris", "dawn", "every-90s", "last-day", "once"]
    assert rows[0]["schedule"]["kind"] == "crontab" and rows[0]["options"]["expires"] == 120
    # stdout is the same export.
    assert sched("export", **run).stdout == before

    names = [row["name"] for row in rows]
    assert sched("delete", *names, "--yes", **run).returncode == 0
    assert client.schedules.list() == []

    result = sched("import", str(exported), "--dry-run", **run)
    assert result.returncode == 0, result.stderr
    assert "Would add 5 schedule(s):" in result.stdout and "every-90s" in result.stdout
    assert client.schedules.list() == []

    result = sched("import", str(exported), **run)
    assert result.returncode == 0, result.stderr
    assert "Added 5 schedule(s):" in result.stdout
    assert "every-90s: cli_app.ping" in result.stdout and "(paused)" in result.stdout
    assert sched("export", **run).stdout == before

    # Again: every name is taken now, left out (not refused), nothing changes.
    result = sched("import", str(exported), **run)
    assert result.returncode == 0, result.stderr
    assert "Added 0 schedule(s)." in result.stdout
    assert result.stdout.count("left out: a schedule of that name is stored") == 5


def test_import_of_a_schedule_file_skips_bad_entries_with_reasons(
    client: Client, pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    good = {"name": "ok", "task": "cli_app.ping", "schedule": {"kind": "interval", "seconds": 60}}
    lines = [
        good,
        {**good, "name": "bad-cron", "schedule": {"kind": "crontab", "minute": "61",
         "hour": "*", "day_of_week": "*", "day_of_month": "*", "month_of_year": "*"}},
        {**good, "name": "bad-zone", "timezone": "Mars/Olympus"},
        {**good, "name": "bad-task", "task": "no.such.task"},
        {**good, "name": "ok"},
        {**good, "name": "code", "source": "static"},
    ]  # fmt: skip
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n{oops\n")
    result = sched("import", str(path), schema=pg_schema, database_url=pg_url)
    one_line_error(result, "5 schedule(s) refused")
    out = result.stdout
    assert "Added 1 schedule(s):" in out
    assert "bad-cron (line 2), refused: InvalidSchedule:" in out and "minute='61'" in out
    assert "bad-zone (line 3), refused: UnknownTimezone:" in out
    assert "bad-task (line 4), refused:" in out and "no.such.task" in out
    assert "ok (line 5), refused: the name is taken by the entry at line 1" in out
    assert "code (line 6), left out: defined in code" in out
    assert "? (line 7), refused: malformed JSON" in out
    assert [info.name for info in client.schedules.list()] == ["ok"]


def test_hostile_rows_are_refused_one_by_one_never_a_traceback(
    client: Client, pg_url: str, pg_schema: str, redis_url: str, unique_name: str, tmp_path: Path
) -> None:
    """Deep nesting, huge and non-finite numbers: each a refused row with its
    line or key, the good rows imported (tests/unit/test_transfer_hostile_rows.py
    has many more)."""
    run = dict(schema=pg_schema, database_url=pg_url)
    deep = "[" * 5000 + "]" * 5000
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        "\n".join([
            deep,
            '{"task": "cli_app.ping", "key": "deep", "args": ' + deep + "}",
            '{"task": "cli_app.ping", "key": "huge", "args": [1' + "0" * 5000 + "]}",
            '{"task": "cli_app.ping", "key": "ok"}',
        ]) + "\n"
    )  # fmt: skip
    result = sched("import", str(jobs), **run)
    one_line_error(result, "3 row(s) refused")
    assert "Read 4 row(s): 1 valid, 1 written, 3 refused." in result.stdout
    assert "line 1: JSON nested more than 100 levels deep" in result.stdout
    assert "line 2: JSON nested" in result.stdout and "line 3: unreadable JSON" in result.stdout
    assert client.get("ok") is not None

    ok = {"name": "fine", "task": "cli_app.ping", "schedule": {"kind": "interval", "seconds": 60}}
    solar_nan = {"kind": "solar", "event": "sunrise", "lat": "nan", "lon": 2}
    schedules = tmp_path / "schedules.jsonl"
    schedules.write_text(
        "\n".join([
            json.dumps(ok),
            json.dumps({**ok, "name": "huge", "schedule": {"kind": "interval", "seconds": 1e300}}),
            json.dumps({**ok, "name": "nan"}).replace("60", "NaN"),
            json.dumps({**ok, "name": "dawn", "schedule": solar_nan}).replace('"nan"', "NaN"),
            json.dumps({**ok, "name": "deep"})[:-1] + ', "args": ' + deep + "}",
        ]) + "\n"
    )  # fmt: skip
    result = sched("import", str(schedules), **run)
    one_line_error(result, "4 schedule(s) refused")
    assert "Added 1 schedule(s):" in result.stdout
    assert "huge (line 2), refused: InvalidSchedule:" in result.stdout
    assert "nan (line 3), refused:" in result.stdout
    assert "dawn (line 4), refused:" in result.stdout and "finite" in result.stdout
    assert "? (line 5), refused: JSON nested more than 100 levels deep" in result.stdout

    prefix = f"{unique_name}:redbeat:"
    redis_client = redis.Redis.from_url(redis_url)
    definitions = {
        "big": {"name": "big", "task": "cli_app.ping",
                "schedule": {"__type__": "interval", "every": 1e300}},
        "neg": {"name": "neg", "task": "cli_app.ping",
                "schedule": {"__type__": "interval", "every": -60}},
        "good": {"name": "good", "task": "cli_app.ping",
                 "schedule": {"__type__": "interval", "every": 60}},
    }  # fmt: skip
    texts = {name: json.dumps(value) for name, value in definitions.items()}
    texts["deep"] = deep
    texts["list"] = "[1, 2]"
    try:
        for score, (name, text) in enumerate(texts.items()):
            redis_client.hset(prefix + name, "definition", text)
            redis_client.zadd(prefix + ":schedule", {prefix + name: score})
        args = ("import", "--from", "redbeat", "--redis-url", redis_url, "--key-prefix", prefix)
        result = sched(*args, **run)
    finally:
        harness.delete_keys(redis_client, unique_name)
        redis_client.close()
    one_line_error(result, "4 schedule(s) refused")
    assert "Added 1 schedule(s):" in result.stdout and "good: cli_app.ping" in result.stdout
    for name in ("big", "neg", "deep", "list"):
        assert f"{name} (Redis key {prefix}{name}), refused:" in result.stdout, name
    assert "Traceback" not in result.stdout + result.stderr


# -- moving from celery-redbeat ----------------------------------------------------------


def test_import_from_redbeat(
    client: Client, pg_url: str, pg_schema: str, redis_url: str, unique_name: str
) -> None:
    from dateutil.rrule import DAILY
    from redbeat import RedBeatSchedulerEntry
    from redbeat.schedules import rrule

    prefix = f"{unique_name}:redbeat:"
    app = Celery("redbeat_source", broker="memory://", set_as_current=False)
    app.conf.update(timezone="UTC", redbeat_redis_url=redis_url, redbeat_key_prefix=prefix)

    def save(name: str, task: str, every: object, **fields: object) -> None:
        RedBeatSchedulerEntry(name, task, every, app=app, **fields).save()

    save("nightly", "cli_app.ping", crontab(minute="15", hour="3"), args=[1, 2],
         kwargs={"k": "v"}, options={"queue": "reports", "priority": 3})  # fmt: skip
    save("every-minute", "cli_app.ping", schedule(dt.timedelta(seconds=60), relative=True))
    save("off", "cli_app.ping", schedule(dt.timedelta(seconds=60)), enabled=False)
    save("by-rrule", "cli_app.ping", rrule(DAILY, dtstart=dt.datetime(2030, 1, 1, tzinfo=dt.UTC)))
    save("unknown-task", "no.such.task", schedule(dt.timedelta(seconds=60)))
    redis_client = redis.Redis.from_url(redis_url)
    redis_client.sadd(prefix + ":statics", "every-minute")  # as if from beat_schedule
    save("from-code", "cli_app.ping", schedule(dt.timedelta(seconds=60)))
    redis_client.sadd(prefix + ":statics", "from-code")
    redis_client.srem(prefix + ":statics", "every-minute")
    run = dict(schema=pg_schema, database_url=pg_url)
    args = ("import", "--from", "redbeat", "--redis-url", redis_url, "--key-prefix", prefix)
    try:
        result = sched(*args, "--dry-run", **run)
        one_line_error(result, "2 schedule(s) refused")
        assert "Would add 2 schedule(s):" in result.stdout
        assert "Dry run: nothing written." in result.stdout
        assert client.schedules.list() == []

        result = sched(*args, **run)
        one_line_error(result, "2 schedule(s) refused")
        out = result.stdout
        assert "Added 2 schedule(s):" in out
        assert "off (Redis key " in out and "left out: disabled" in out
        assert "from-code (Redis key " in out and "left out: from the app's beat_schedule" in out
        assert "by-rrule (Redis key " in out and "unsupported schedule type 'rrule'" in out
        assert "unknown-task (Redis key " in out and "no.such.task" in out
    finally:
        harness.delete_keys(redis_client, unique_name)
        redis_client.close()

    nightly = client.schedules.get("nightly")
    assert nightly is not None and nightly.kind == "crontab"
    assert (nightly.spec["minute"], nightly.spec["hour"]) == ("15", "3")
    assert nightly.args == (1, 2) and nightly.kwargs == {"k": "v"}
    assert nightly.options == {"queue": "reports", "priority": 3}
    every = client.schedules.get("every-minute")
    assert every is not None and every.spec == {"seconds": 60.0} and every.relative

    result = sched("import", "--from", "redbeat", "--redis-url", "redis://127.0.0.1:1/0", **run)
    one_line_error(result, "cannot read redbeat's entries", "127.0.0.1:1")


# -- moving from django-celery-beat ------------------------------------------------------


@pytest.fixture
def dcb_schema(pg_url: str, unique_name: str) -> Iterator[str]:
    """A schema holding django-celery-beat's tables, made by its own migrations
    and filled through its models (``tests/integration/dcb_seed.py``)."""
    schema = f"{unique_name}_dcb"
    conninfo = pg_url.replace("+psycopg", "")
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        subprocess.run(
            [sys.executable, "-m", "tests.integration.dcb_seed"],
            cwd=ROOT,
            env={"PATH": "/usr/bin:/bin", "DCB_URL": pg_url, "DCB_SCHEMA": schema},
            check=True,
            timeout=120,
        )
        yield schema
    finally:
        harness.drop_schema(pg_url, schema)


def test_import_from_django_celery_beat(
    client: Client, pg_url: str, pg_schema: str, dcb_schema: str
) -> None:
    run = dict(schema=pg_schema, database_url=pg_url)
    args = ("import", "--from", "django-celery-beat", "--database-url", pg_url)
    result = sched(*args, "--db-schema", dcb_schema, "--dry-run", **run)
    one_line_error(result, "3 schedule(s) refused")
    assert "Would add 4 schedule(s):" in result.stdout
    assert client.schedules.list() == []

    result = sched(*args, "--db-schema", dcb_schema, **run)
    one_line_error(result, "3 schedule(s) refused")
    out = result.stdout
    assert "Added 4 schedule(s):" in out
    assert "switched-off (periodic task 'switched-off'), left out: disabled" in out
    assert "once-a-minute-once" in out and "one_off on a interval schedule" in out
    assert "not-registered" in out and "no.such.task" in out
    assert "bad-minute (periodic task 'bad-minute'), refused: InvalidSchedule:" in out
    assert "minute='61'" in out

    infos = {info.name: info for info in client.schedules.list()}
    assert sorted(infos) == ["at-dawn", "every-90s", "nightly", "once"]
    nightly = infos["nightly"]
    assert nightly.kind == "crontab" and nightly.timezone == "Europe/Paris"
    assert (nightly.spec["minute"], nightly.spec["hour"], nightly.spec["day_of_week"]) == (
        "30",
        "2",
        "1-5",
    )
    assert nightly.args == (1, "two") and nightly.kwargs == {"three": 3}
    assert nightly.options == {
        "queue": "reports",
        "priority": 7,
        "headers": {"source": "dcb"},
        "expires": 120,
    }
    assert infos["every-90s"].spec == {"seconds": 90.0}
    assert infos["at-dawn"].kind == "solar" and infos["at-dawn"].spec["event"] == "sunrise"
    assert infos["once"].kind == "clocked" and infos["once"].spec["at"] == "2031-01-02T03:04:05Z"

    # Tables that are not there: one line, naming the schema.
    one_line_error(sched(*args, "--db-schema", "no_such_schema", **run), "no_such_schema")
    # A missing option is a usage error (click's exit status 2).
    result = sched("import", "--from", "django-celery-beat", **run)
    assert result.returncode == 2 and "needs --database-url" in result.stderr
