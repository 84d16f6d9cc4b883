"""Drop-in fidelity (issue 15): a real project switches its beat and nothing else changes.

Two projects under ``tests/e2e/projects/`` are written as stock-beat projects
with nothing of celery_sched in them:

- ``classic``: ``app.config_from_object("proj.celeryconfig")``, a settings
  module in Celery 3's upper-case names (``BROKER_URL``,
  ``CELERY_TASK_SERIALIZER``, ``CELERY_ROUTES``, ``CELERYBEAT_SCHEDULE``, ...),
  on RabbitMQ, with a Redis result backend; celery_sched's two URLs come from
  the environment.
- ``djangoshop``: a Django project whose Celery app reads
  ``config_from_object("django.conf:settings", namespace="CELERY")``, with
  ``CELERY_BEAT_SCHEDULE`` in ``tests/e2e/projects/djangoshop/shop/settings.py``, on Redis, which
  reads ``CELERY_SCHED_DATABASE_URL`` / ``CELERY_SCHED_REDIS_URL`` from the
  environment.

Each has the pickle serializer (arguments only pickle can carry: a dataclass
of the project, datetimes, sets), a custom schedule class (a
``BaseSchedule`` / ``schedule`` subclass with its own ``is_due``), a
``task_routes`` function routing by the arguments to two queues, and
``before_task_publish`` / ``after_task_publish`` receivers that add a header
and log every send. Its tasks append one JSON line per run to a run log,
its publish receivers one per signal to a publish log.

The test runs the project twice at once, each copy on queues of its own with
logs of its own and a worker consuming both its queues: once with
``celery -A <project> beat -S celery_sched`` and once with the same command
without ``-S``. Over the same window it checks, for celery_sched, that every
entry ran once per nominal instant (the custom one on its own marks), never
twice, with its pickled arguments intact, on the queue its arguments chose,
carrying the header the publish receiver added in the beat process; and that
stock beat ran the same entries as often, give or take one.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import socket
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection

from celery_sched.settings import Settings
from tests.e2e.harness import CELERY, Proc, ProcessGroup, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROJECTS = Path(__file__).resolve().parent / "projects"
#: Seconds both beats run side by side, counted once both have sent a task.
WINDOW = 24.0
HOST = socket.gethostname()
#: celery_sched_visibility_timeout of the run, in seconds.
VISIBILITY_TIMEOUT = 8.0


@dataclasses.dataclass(frozen=True)
class Entry:
    """What one beat entry of a project should do."""

    task: str
    #: The parcel's ref (tasks that take a parcel), else None.
    ref: str | None
    #: Seconds between runs (an interval), else None.
    every: float | None
    #: A custom schedule's instants: whether an epoch second is one.
    on_mark: Callable[[int], bool] | None
    #: The queue (without the copy's prefix) the router picks from the arguments.
    lane: str
    #: What the worker saw of the arguments.
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Project:
    name: str
    app: str
    broker: str
    lanes: tuple[str, str]
    entries: dict[str, Entry]
    #: Names of the variables giving a copy its queue prefix, run log and
    #: publish log, and the broker URL.
    prefix_var: str
    run_log_var: str
    publish_log_var: str
    broker_var: str
    #: The header the project's before_task_publish receiver adds.
    header: str
    #: Where the project gives celery_sched its URLs, as the beat banner
    #: says it: ``environment`` or ``app config``.
    url_origin: str

    @property
    def path(self) -> Path:
        return PROJECTS / self.name


AUDIT_SECONDS = (0, 7, 15, 22, 30, 37, 45, 52)

CLASSIC = Project(
    name="classic",
    app="proj",
    broker="amqp",
    lanes=("express", "standard"),
    prefix_var="QUEUE_PREFIX",
    run_log_var="RUN_LOG",
    publish_log_var="PUBLISH_LOG",
    broker_var="BROKER_URL",
    header="x_published_by",
    url_origin="environment",
    entries={
        "express-pickup": Entry(
            task="proj.tasks.pickup",
            ref="EX-1",
            every=2.0,
            on_mark=None,
            lane="express",
            arguments={
                "type": "proj.models.Parcel",
                "ref": "EX-1",
                "express": True,
                "ready_at": "2031-05-06T07:08:09+00:00",
                "labels": ["fragile", "signed"],
                "labels_type": "frozenset",
            },
        ),
        "standard-pickup": Entry(
            task="proj.tasks.pickup",
            ref="ST-1",
            every=3.0,
            on_mark=None,
            lane="standard",
            arguments={
                "type": "proj.models.Parcel",
                "ref": "ST-1",
                "express": False,
                "ready_at": "2031-05-06T12:00:00+00:00",
                "labels": ["bulky"],
                "labels_type": "frozenset",
            },
        ),
        "urgent-audit": Entry(
            task="proj.tasks.audit",
            ref=None,
            every=None,
            on_mark=lambda second: second % 60 in AUDIT_SECONDS,
            lane="express",
            arguments={
                "urgent": True,
                "since": "2024-02-29T23:59:59.123456+00:00",
                "depots": ["LHR", "MAN"],
                "depots_type": "set",
            },
        ),
    },
)

DJANGO = Project(
    name="djangoshop",
    app="shop",
    broker="redis",
    lanes=("priority", "economy"),
    prefix_var="SHOP_QUEUE_PREFIX",
    run_log_var="SHOP_RUN_LOG",
    publish_log_var="SHOP_PUBLISH_LOG",
    broker_var="CELERY_BROKER_URL",
    header="x_origin",
    url_origin="app config",
    entries={
        "priority-collection": Entry(
            task="parcels.tasks.collect",
            ref="PR-7",
            every=2.0,
            on_mark=None,
            lane="priority",
            arguments={
                "type": "parcels.values.Parcel",
                "ref": "PR-7",
                "priority": True,
                "booked_at": "2030-12-31T23:30:00+00:00",
                "sizes": ["S", "XL"],
                "sizes_type": "set",
            },
        ),
        "economy-collection": Entry(
            task="parcels.tasks.collect",
            ref="EC-3",
            every=3.0,
            on_mark=None,
            lane="economy",
            arguments={
                "type": "parcels.values.Parcel",
                "ref": "EC-3",
                "priority": False,
                "booked_at": "2030-01-02T03:04:05.000006+00:00",
                "sizes": ["M"],
                "sizes_type": "set",
            },
        ),
        "stock-count": Entry(
            task="parcels.tasks.count_stock",
            ref=None,
            every=None,
            on_mark=lambda second: second % 4 == 0,
            lane="economy",
            arguments={
                "aisles": ["aisle-1", "aisle-2"],
                "aisles_type": "set",
                "day": "datetime.date(2030, 6, 1)",
            },
        ),
    },
)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines log (a line being written is left out)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


@dataclasses.dataclass
class Copy:
    """One copy of the project: its queues, logs, worker and beat."""

    label: str
    prefix: str
    run_log: Path
    publish_log: Path
    worker: Proc | None = None
    beat: Proc | None = None

    def runs(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_log)

    def published(self) -> list[dict[str, Any]]:
        return read_jsonl(self.publish_log)


class ProjectGroup(ProcessGroup):
    """A project's worker and beat commands, run as its operators would."""

    def __init__(
        self, *, tmp_path: Path, settings: Settings, project: Project, broker_url: str
    ) -> None:
        self.project = project
        self.broker_url = broker_url
        self.copies: list[Copy] = []
        super().__init__(
            tmp_path=tmp_path,
            settings=settings,
            env={
                "PYTHONPATH": str(project.path),
                project.broker_var: broker_url,
                "RESULT_BACKEND": settings.redis_url,
                "SHOP_SQLITE": str(tmp_path / "shop.sqlite3"),
                # A worker accepting pickle refuses to run as root without it
                # (this machine's tests run as root).
                "C_FORCE_ROOT": "1",
            },
        )

    def copy(self, label: str) -> Copy:
        made = Copy(
            label=label,
            prefix=f"{label}_{uuid.uuid4().hex[:8]}_",
            run_log=self.tmp_path / f"{label}-runs.jsonl",
            publish_log=self.tmp_path / f"{label}-published.jsonl",
        )
        self.copies.append(made)
        return made

    def _copy_env(self, copy: Copy) -> dict[str, str]:
        project = self.project
        return {
            project.prefix_var: copy.prefix,
            project.run_log_var: str(copy.run_log),
            project.publish_log_var: str(copy.publish_log),
        }

    def queues(self, copy: Copy) -> list[str]:
        return [copy.prefix + lane for lane in self.project.lanes]

    def start_worker(self, copy: Copy) -> Proc:
        copy.worker = self._spawn(
            f"{copy.label}-worker",
            [
                CELERY,
                "-A",
                self.project.app,
                "worker",
                "-Q",
                ",".join(self.queues(copy)),
                "--concurrency=2",
                "-n",
                f"{copy.prefix}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=WARNING",
            ],
            self._copy_env(copy),
        )
        return copy.worker

    def start_beat(self, copy: Copy, *scheduler: str) -> Proc:
        """``celery -A <app> beat`` plus ``scheduler`` (``-S celery_sched``, or nothing)."""
        copy.beat = self._spawn(
            f"{copy.label}-beat",
            [
                CELERY,
                "-A",
                self.project.app,
                "beat",
                *scheduler,
                "-s",
                str(self.tmp_path / f"{copy.label}-celerybeat-schedule"),
                "--loglevel=INFO",
            ],
            self._copy_env(copy),
        )
        return copy.beat

    def delete_queues(self) -> None:
        with Connection(self.broker_url) as conn:
            channel = conn.default_channel
            for copy in self.copies:
                for queue in self.queues(copy):
                    channel.queue_delete(queue)
        if self.broker_url.startswith("redis"):
            # Kombu's bindings and any message left: every key naming a queue
            # of a copy (its prefix is unique to this test).
            with redis.Redis.from_url(self.broker_url) as client:
                for copy in self.copies:
                    keys = list(client.scan_iter(match=f"*{copy.prefix}*", count=1000))
                    if keys:
                        client.delete(*keys)


@pytest.fixture(
    params=[pytest.param(CLASSIC, marks=pytest.mark.needs_rabbitmq), DJANGO],
    ids=lambda project: project.name,
)
def project(request: pytest.FixtureRequest) -> Project:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def group(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    settings: Settings,
    project: Project,
    redis_url: str,
) -> Iterator[ProjectGroup]:
    # The URLs, the schema and the key prefix; and a visibility timeout short
    # enough for the jobs sent early in the run to end `sent`, as the README
    # says a job of an untracked worker does.
    settings = dataclasses.replace(settings, visibility_timeout=VISIBILITY_TIMEOUT)
    broker_url = redis_url if project.broker == "redis" else request.getfixturevalue("amqp_url")
    built = ProjectGroup(
        tmp_path=tmp_path, settings=settings, project=project, broker_url=broker_url
    )
    yield built
    built.stop_all()
    built.delete_queues()
    print(built.dump_logs())  # shown only when the test failed


def running(*procs: Proc | None) -> bool:
    """True; raises when one of ``procs`` has exited (its log is printed on failure)."""
    for proc in procs:
        assert proc is not None and proc.alive(), f"{proc and proc.name} exited"
    return True


def first_sent(copy: Copy) -> float | None:
    sent = [row["at"] for row in copy.published() if row["signal"] == "after"]
    return min(sent) if sent else None


def entry_of(project: Project, run: dict[str, Any]) -> str:
    """The beat entry a worker's run came from, by task and argument."""
    ref = (run.get("parcel") or {}).get("ref")
    [name] = [
        name
        for name, entry in project.entries.items()
        if entry.task == run["task"] and entry.ref == ref
    ]
    return name


def marks(on_mark: Callable[[int], bool], start: float, end: float) -> list[float]:
    """The whole epoch seconds in ``[start, end)`` that are a custom schedule's instants."""
    return [float(s) for s in range(math.ceil(start), math.ceil(end)) if on_mark(s)]


def check_carried(project: Project, copy: Copy, runs: list[dict[str, Any]]) -> None:
    """Each run: its pickled arguments intact, on the queue its arguments
    chose, with the header the beat process's before_task_publish added, and
    both publish receivers fired once for it, in the beat process."""
    assert copy.beat is not None
    publisher = f"{HOST}:{copy.beat.pid}"
    signals = defaultdict(list)
    for row in copy.published():
        signals[row["id"]].append(row)
    for run in runs:
        name = entry_of(project, run)
        entry = project.entries[name]
        where = (copy.label, name, run)
        described = run.get("parcel") or run.get("audit") or run.get("stock")
        assert described == entry.arguments, where
        assert run["routing_key"] == copy.prefix + entry.lane, where
        assert run["published_by"] == publisher, where
        assert run["from_beat"] is True, where
        before, after = signals[run["id"]]
        assert (before["signal"], after["signal"]) == ("before", "after"), where
        assert before["pid"] == after["pid"] == copy.beat.pid, where
        assert before["task"] == after["task"] == run["task"], where
        assert after["published_by"] == publisher, where
        assert after["routing_key"] == run["routing_key"], where


def test_a_project_switches_its_beat_and_nothing_else_changes(
    group: ProjectGroup, project: Project
) -> None:
    sched, stock = group.copy("sched"), group.copy("stock")
    for copy in (sched, stock):
        group.start_worker(copy)
    # The one difference between the two copies' commands.
    group.start_beat(sched, "-S", "celery_sched")
    group.start_beat(stock)
    procs = (sched.worker, stock.worker, sched.beat, stock.beat)

    wait_for(
        lambda: running(*procs) and first_sent(sched) and first_sent(stock),
        timeout=45,
        what="both beats sending tasks",
    )
    start = time.time() + 0.5
    end = start + WINDOW
    time.sleep(end + 2 - time.time())
    assert running(*procs)
    assert sched.beat is not None and stock.beat is not None
    sched.beat.stop()
    stock.beat.stop()

    jobs = group.query(
        "SELECT j.id::text, s.name, extract(epoch FROM j.due_at)::float8, j.status "
        "FROM {s}.jobs j JOIN {s}.schedules s ON s.id = j.schedule_id"
    )
    job_of = {str(job_id): (str(name), float(due)) for job_id, name, due, _ in jobs}
    owed = {str(job_id) for job_id, _, due, _ in jobs if due < end}
    wait_for(
        lambda: running(sched.worker) and owed <= {run["id"] for run in sched.runs()},
        timeout=30,
        what="every job due before the end to run",
    )
    wait_for(
        lambda: (
            running(stock.worker)
            and {r["id"] for r in stock.published() if r["signal"] == "after"}
            <= {r["id"] for r in stock.runs()}
        ),
        timeout=30,
        what="every task stock beat sent to run",
    )
    sched_runs, stock_runs = sched.runs(), stock.runs()

    # -- celery_sched: once per nominal instant, none twice -----------------------
    assert [n for n in Counter(r["id"] for r in sched_runs).values() if n > 1] == []
    # Every run is an occurrence of the entry its arguments name.
    assert all(job_of[run["id"]][0] == entry_of(project, run) for run in sched_runs)
    assert {str(status) for _, _, due, status in jobs if due < end} <= {"dispatched", "sent"}
    # Untracked workers: a job ends `sent` a visibility timeout after it was
    # dispatched (the reconciler runs every 5 s), and is never sent again.
    settled = end + 2 - VISIBILITY_TIMEOUT - 5 - 2
    assert {str(status) for _, _, due, status in jobs if due < settled} == {"sent"}
    dues: dict[str, list[float]] = {name: [] for name in project.entries}
    for name, due in job_of.values():
        if start <= due < end:
            dues[name].append(due)
    for name, entry in project.entries.items():
        instants = sorted(dues[name])
        if entry.every is not None:
            steps = {round(b - a, 6) for a, b in itertools.pairwise(instants)}
            assert steps == {entry.every}, (name, instants)
            assert len(instants) == round(WINDOW / entry.every), (name, instants)
        else:
            assert entry.on_mark is not None
            assert instants == marks(entry.on_mark, start, end), name
    # On time: sent close to the nominal instant.
    sched_sent = {r["id"]: r["at"] for r in sched.published() if r["signal"] == "after"}
    lags = sorted(sched_sent[job_id] - job_of[job_id][1] for job_id in owed)
    assert lags[len(lags) // 2] < 1.0, lags

    # -- what each run carried, under either beat ----------------------------------
    check_carried(project, sched, sched_runs)
    check_carried(project, stock, stock_runs)

    # -- stock beat over the same window: the same entries, as often ---------------
    assert [n for n in Counter(r["id"] for r in stock_runs).values() if n > 1] == []
    stock_sent = {r["id"]: r["at"] for r in stock.published() if r["signal"] == "after"}
    stock_counts = Counter(
        entry_of(project, run) for run in stock_runs if start <= stock_sent[run["id"]] < end
    )
    sched_counts = {name: len(instants) for name, instants in dues.items()}
    assert set(stock_counts) == set(sched_counts)
    for name in project.entries:
        # Timing edges: stock beat counts from its own start and drifts.
        assert abs(stock_counts[name] - sched_counts[name]) <= 1, (stock_counts, sched_counts)
    for run in stock_runs:
        entry = project.entries[entry_of(project, run)]
        if entry.on_mark is not None:
            # Stock beat drives the custom class on the same marks.
            sent = int(stock_sent[run["id"]])
            assert entry.on_mark(sent) or entry.on_mark(sent - 1), run

    # The banner names the scheduler, and where celery_sched found its URL.
    assert ". scheduler -> celery_sched.beat.Scheduler" in sched.beat.output()
    banner = sched.beat.output()
    assert f"(schema {group.schema}; from {project.url_origin} CELERY_SCHED_DATABASE_URL)" in banner
    assert (
        f"(prefix {group.settings.key_prefix}; from {project.url_origin} CELERY_SCHED_REDIS_URL)"
        in banner
    )
    assert ". scheduler -> celery.beat.PersistentScheduler" in stock.beat.output()
