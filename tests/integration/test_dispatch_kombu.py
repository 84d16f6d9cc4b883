"""KombuDispatcher against real brokers, with a real ``celery worker`` running the messages.

What every dispatcher must do is the Dispatcher contract
(``tests/contract/test_dispatcher_contract.py``); here is what is Kombu's own: a stock
worker running the messages, task-sent events, retries, chunk accounting, Redis key
prefixes and error replies, the RabbitMQ wire format.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Queue
from kombu.serialization import dumps
from kombu.utils.encoding import safe_repr

from celery_sched.dispatch import path_redis, sent_events
from celery_sched.dispatch.fast_path import PublishPath
from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.models import Job, JobStatus
from celery_sched.settings import Settings
from celery_sched.timeutil import to_bucket
from tests.integration.dispatch_app import RECORD_TASK, ROUTED_TASK, make_app

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def make_job(
    task: str,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    key: str | None = None,
    options: dict[str, Any] | None = None,
    expires_at: dt.datetime | None = None,
    attempt: int = 0,
    due_at: dt.datetime | None = None,
    schedule_id: int | None = None,
) -> Job:
    kwargs = kwargs or {}
    content_type, encoding, body = dumps([list(args), kwargs, EMBED], serializer="json")
    now = due_at or dt.datetime.now(dt.UTC)
    return Job(
        id=uuid.uuid4(),
        key=key or f"job-{uuid.uuid4().hex[:8]}",
        task=task,
        body=body if isinstance(body, bytes) else body.encode(),
        content_type=content_type,
        content_encoding=encoding,
        argsrepr=safe_repr(args),
        kwargsrepr=safe_repr(kwargs),
        due_at=now,
        due_bucket=to_bucket(now),
        status=JobStatus.DISPATCHED,
        options=options or {},
        expires_at=expires_at,
        attempt=attempt,
        schedule_id=schedule_id,
    )


def take(app: Celery, queue: str) -> list[Any]:
    """Every message in ``queue``, in arrival order, as a consumer gets them."""
    got = []
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            got.append(message)
    return got


class Worker:
    """A stock ``celery worker`` subprocess on the given queues."""

    def __init__(self, broker: str, redis_url: str, queues: list[str], routed_queue: str) -> None:
        self.results_key = "dispatch_results_" + uuid.uuid4().hex[:12]
        self.redis = redis.Redis.from_url(redis_url)
        env = dict(
            os.environ,
            DISPATCH_TEST_BROKER=broker,
            DISPATCH_TEST_REDIS=redis_url,
            DISPATCH_TEST_RESULTS=self.results_key,
            DISPATCH_TEST_ROUTED_QUEUE=routed_queue,
        )
        self.process = subprocess.Popen(
            [
                CELERY,
                "-A",
                "tests.integration.dispatch_app",
                "worker",
                "--pool=solo",
                "-Q",
                ",".join(queues),
                "-n",
                f"w-{uuid.uuid4().hex[:6]}@%h",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
                "--loglevel=WARNING",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def results(self, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.redis.llen(self.results_key) >= count:
                break
            assert self.process.poll() is None, self.process.stderr.read().decode()  # type: ignore[union-attr]
            time.sleep(0.1)
        return [json.loads(raw) for raw in self.redis.lrange(self.results_key, 0, -1)]

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.redis.delete(self.results_key)
        self.redis.close()


def delete_queues(app: Celery, queues: list[str], redis_url: str) -> None:
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        for queue in queues:
            channel.queue_delete(queue)
    if app.conf.broker_url.startswith("redis"):
        client = redis.Redis.from_url(redis_url)
        client.delete(*(f"_kombu.binding.{queue}" for queue in queues))
        client.close()


@pytest.fixture(params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest, redis_url: str) -> str:
    if request.param == "redis":
        return redis_url
    return str(request.getfixturevalue("amqp_url"))


@pytest.fixture
def queues(unique_name: str) -> dict[str, str]:
    return {name: f"{unique_name}_{name}" for name in ("default", "routed", "option")}


@pytest.fixture
def publisher_app(broker: str, queues: dict[str, str], redis_url: str) -> Iterator[Celery]:
    app = make_app(broker, queues["routed"])
    app.conf.task_default_queue = queues["default"]
    yield app
    delete_queues(app, list(queues.values()), redis_url)


@pytest.fixture
def worker(
    broker: str, redis_url: str, queues: dict[str, str], publisher_app: Celery
) -> Iterator[Worker]:
    process = Worker(broker, redis_url, list(queues.values()), queues["routed"])
    yield process
    process.stop()


def test_stock_worker_runs_published_jobs(
    publisher_app: Celery, worker: Worker, queues: dict[str, str], redis_url: str
) -> None:
    settings = Settings(redis_url=redis_url, hostname="celery_sched@test")
    dispatcher = KombuDispatcher(publisher_app, settings)
    now = dt.datetime.now(dt.UTC)
    plain = [make_job(RECORD_TASK, (i, "a"), {"n": i}, attempt=2) for i in range(20)]
    routed = make_job(ROUTED_TASK, ("routed",), key="routed-job")
    by_option = make_job(
        RECORD_TASK,
        ("by-option",),
        options={"queue": queues["option"], "priority": 7, "headers": {"x_custom": "yes"}},
    )
    expiring = make_job(RECORD_TASK, ("later",), expires_at=now + dt.timedelta(minutes=5))
    expired = make_job(RECORD_TASK, ("too late",), expires_at=now - dt.timedelta(seconds=1))
    jobs = [*plain, routed, expired, by_option, expiring]
    try:
        result = dispatcher.publish(jobs, epoch=42, now=now)
    finally:
        dispatcher.close()

    assert result.failed == []
    assert result.expired == [expired.id]
    assert sorted(result.sent) == sorted(j.id for j in jobs if j is not expired)

    runs = worker.results(len(jobs) - 1)
    time.sleep(0.5)  # a late duplicate or the expired job would show up here
    runs = worker.results(len(jobs) - 1)
    by_id = {run["id"]: run for run in runs}
    assert len(runs) == len(jobs) - 1 == len(by_id)  # each exactly once
    assert str(expired.id) not in by_id
    for job in plain:
        run = by_id[str(job.id)]
        assert run["task"] == RECORD_TASK
        assert run["args"] == list(job.args) and run["kwargs"] == job.kwargs
        assert run["root_id"] == str(job.id)
        assert run["key"] == job.key and run["attempt"] == 2 and run["epoch"] == 42
        assert run["beat"] is True
        assert run["origin"] == "celery_sched@test"
        assert run["routing_key"] == queues["default"]
    assert by_id[str(routed.id)]["task"] == ROUTED_TASK
    assert by_id[str(routed.id)]["routing_key"] == queues["routed"]
    assert by_id[str(routed.id)]["key"] == "routed-job"
    option_run = by_id[str(by_option.id)]
    assert option_run["routing_key"] == queues["option"]
    assert option_run["priority"] == 7
    assert option_run["custom"] == "yes"
    assert by_id[str(expiring.id)]["args"] == ["later"]


def test_task_sent_events_name_the_scheduler(
    broker: str, queues: dict[str, str], publisher_app: Celery, redis_url: str
) -> None:
    publisher_app.conf.task_send_sent_event = True
    events: list[dict[str, Any]] = []
    ready = threading.Event()
    listening = threading.Event()
    with publisher_app.connection_for_read() as conn:

        def on_event(event: dict[str, Any]) -> None:
            if event.get("type") == "celery-sched-probe":
                listening.set()
                return
            if event.get("type") != "task-sent":
                return
            events.append(event)
            # capture(limit=...) would count every event on the exchange,
            # heartbeats of other workers included; stop on ours only.
            if len(events) >= 3:
                receiver.should_stop = True

        receiver = publisher_app.events.Receiver(conn, handlers={"*": on_event}, queue_ttl=60)
        receiver.on_consume_ready = lambda *a, **kw: ready.set()  # type: ignore[method-assign]
        errors: list[BaseException] = []

        def capture() -> None:
            try:
                receiver.capture(limit=None, timeout=15, wakeup=False)
            except BaseException as exc:  # surfaced by the assertions below
                errors.append(exc)

        thread = threading.Thread(target=capture, daemon=True)
        thread.start()
        assert ready.wait(10)
        # The Redis fanout subscribes on the receiver's first poll, and an
        # event published before that is gone: probe until one arrives.
        with publisher_app.events.default_dispatcher() as probe:
            deadline = time.monotonic() + 15
            while not listening.wait(0.2):
                assert time.monotonic() < deadline, "the event receiver never listened"
                probe.send("celery-sched-probe")

        settings = Settings(redis_url=redis_url, hostname="celery_sched@events-test")
        dispatcher = KombuDispatcher(publisher_app, settings)
        jobs = [make_job(RECORD_TASK, (i,), {"k": "v"}) for i in range(3)]
        try:
            result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
        finally:
            dispatcher.close()
        assert len(result.sent) == 3
        thread.join(20)
        receiver.should_stop = True

    assert not errors, errors
    by_uuid = {event["uuid"]: event for event in events}
    assert set(by_uuid) == {str(job.id) for job in jobs}
    for job in jobs:
        event = by_uuid[str(job.id)]
        assert event["type"] == "task-sent"
        assert event["name"] == RECORD_TASK
        assert event["args"] == job.argsrepr
        assert event["kwargs"] == job.kwargsrepr
        assert event["hostname"] == "celery_sched@events-test"
        assert event["queue"] == queues["default"]
        assert event["root_id"] == str(job.id)
        assert event["retries"] == 0


def test_unreachable_broker_fails_everything_without_raising(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = Celery("unreachable", broker="redis://:secret@127.0.0.1:1/0", set_as_current=False)
    settings = Settings(hostname="celery_sched@test", connect_retries=3, retry_backoff=0.05)
    dispatcher = KombuDispatcher(app, settings)
    jobs = [make_job(RECORD_TASK, (i,)) for i in range(5)]
    start = time.monotonic()
    with caplog.at_level("WARNING"):
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
    elapsed = time.monotonic() - start
    dispatcher.close()
    assert result.sent == [] and result.expired == []
    assert sorted(result.failed) == sorted(job.id for job in jobs)
    assert elapsed < 10
    retries = [
        r for r in caplog.records if r.levelname == "WARNING" and "retrying" in r.getMessage()
    ]
    assert len(retries) == 2  # attempts - 1
    assert all("secret" not in r.getMessage() for r in caplog.records)


def test_failed_flush_midway_republishes_only_unconfirmed_chunks(
    redis_url: str, unique_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(redis_url, unique_name + "_routed")
    app.conf.task_default_queue = unique_name
    dispatcher = KombuDispatcher(
        app, Settings(redis_url=redis_url, retry_backoff=0.01), chunk=2, sleep=lambda _: None
    )
    calls = {"n": 0}
    real_push = path_redis.push_lists

    def flaky_push(client: Any, lists: dict[str, list[bytes]]) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the second chunk's round trip is lost
            raise redis.exceptions.ConnectionError("connection reset")
        real_push(client, lists)

    monkeypatch.setattr(path_redis, "push_lists", flaky_push)
    jobs = [make_job(RECORD_TASK, (i,)) for i in range(6)]
    client = redis.Redis.from_url(redis_url)
    try:
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
        assert result.failed == [] and result.expired == []
        assert result.sent == [job.id for job in jobs]
        # The first chunk was confirmed before the failure and is not sent again;
        # the failed chunk had not reached Redis, so nothing is duplicated.
        raw = client.lrange(unique_name, 0, -1)
        ids = [json.loads(item)["headers"]["id"] for item in reversed(raw)]
        assert ids == [str(job.id) for job in jobs]
    finally:
        dispatcher.close()
        client.delete(unique_name, f"_kombu.binding.{unique_name}")
        client.close()


def test_redis_global_keyprefix_is_applied(redis_url: str, unique_name: str) -> None:
    """Messages land in the prefixed list a Kombu consumer with the same prefix reads."""
    prefix = f"pfx_{unique_name}:"
    app = make_app(redis_url, unique_name + "_routed")
    app.conf.task_default_queue = unique_name
    app.conf.broker_transport_options = {"global_keyprefix": prefix}
    dispatcher = KombuDispatcher(app, Settings(redis_url=redis_url))
    jobs = [make_job(RECORD_TASK, (i,)) for i in range(3)]
    client = redis.Redis.from_url(redis_url)
    try:
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
        assert result.sent == [job.id for job in jobs]
        assert client.llen(unique_name) == 0
        assert client.llen(prefix + unique_name) == len(jobs)
        received = []
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            while (message := channel.basic_get(unique_name, no_ack=True)) is not None:
                received.append(message.headers["id"])
        assert received == [str(job.id) for job in jobs]
    finally:
        dispatcher.close()
        keys = client.keys(f"{prefix}*")
        client.delete(*keys, unique_name, f"_kombu.binding.{unique_name}")
        client.close()


def test_rabbitmq_messages_equal_what_kombu_publishes(
    amqp_url: str, queues: dict[str, str], redis_url: str
) -> None:
    """The direct py-amqp path (properties encoded by celery_sched) puts on
    the wire exactly what Kombu's own publish puts there: the same
    properties, headers, body and routing for every kind of job."""
    app = make_app(amqp_url, queues["routed"])
    app.conf.task_default_queue = queues["default"]
    now = dt.datetime.now(dt.UTC)
    jobs = [
        make_job(RECORD_TASK, (1, "a"), {"n": 1}, attempt=3),
        make_job(ROUTED_TASK, ("routed",), key=str(uuid.uuid4())),
        make_job(
            RECORD_TASK,
            ("opts",),
            options={
                "queue": queues["option"],
                "priority": 7,
                "headers": {"x_custom": "yes", "nested": {"a": [1, None, "é"]}},
                "time_limit": 30,
                "ignore_result": True,
            },
        ),
        make_job(RECORD_TASK, ("later",), expires_at=now + dt.timedelta(minutes=5)),
    ]
    received: dict[str, list[dict[str, Any]]] = {}
    try:
        for mode, path in (("auto", PublishPath.AMQP), ("off", PublishPath.KOMBU)):
            settings = Settings(
                redis_url=redis_url, hostname="celery_sched@test", fast_publish=mode
            )
            dispatcher = KombuDispatcher(app, settings)
            try:
                result = dispatcher.publish(jobs, epoch=5, now=now)
            finally:
                dispatcher.close()
            assert sorted(result.sent) == sorted(job.id for job in jobs)
            assert dispatcher.sent_by_path == {path: len(jobs)}
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            for name in queues.values():
                # The raw frames' decoding: what a consumer receives.
                while (message := channel.basic_get(queue=name, no_ack=True)) is not None:
                    properties = dict(message.properties)
                    received.setdefault(properties["correlation_id"], []).append(
                        {
                            "queue": name,
                            "properties": properties,
                            "body": message.body,
                            "routing_key": message.delivery_info["routing_key"],
                            "exchange": message.delivery_info["exchange"],
                        }
                    )
    finally:
        delete_queues(app, list(queues.values()), redis_url)
    assert sorted(received) == sorted(str(job.id) for job in jobs)
    for task_id, pair in received.items():
        assert len(pair) == 2, task_id
        assert pair[0] == pair[1], task_id
    opts = received[str(jobs[2].id)][0]
    assert opts["properties"]["priority"] == 7
    assert opts["properties"]["application_headers"]["nested"] == {"a": [1, None, "é"]}
    assert opts["queue"] == queues["option"]
    assert int(received[str(jobs[3].id)][0]["properties"]["expiration"]) > 290_000


# -- per-queue failures, as each broker reports them (issue 13) -------------------------


def test_a_queue_name_holding_another_redis_type_fails_only_its_jobs(
    redis_url: str, unique_name: str
) -> None:
    """WRONGTYPE was a broker failure: the whole batch was released. Both
    where it shows: declaring the queue, and the LPUSH once it is declared."""
    app = make_app(redis_url, unique_name + "_routed")
    app.conf.task_default_queue = unique_name
    bad_queue = unique_name + "_bad"
    client = redis.Redis.from_url(redis_url)
    dispatcher = KombuDispatcher(app, Settings(redis_url=redis_url), chunk=20)
    try:
        for when in ("declare", "push"):
            client.delete(bad_queue)
            if when == "push":
                # Declared by a good publish first; then the key changes type.
                first = make_job(RECORD_TASK, ("first",), options={"queue": bad_queue})
                assert dispatcher.publish([first], epoch=1, now=dt.datetime.now(dt.UTC)).sent
                client.delete(bad_queue)
            client.set(bad_queue, "not a list")
            good = [make_job(RECORD_TASK, (i,)) for i in range(50)]
            bad = make_job(RECORD_TASK, ("bad",), options={"queue": bad_queue})
            jobs = [*good[:25], bad, *good[25:]]
            result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
            assert sorted(result.sent) == sorted(job.id for job in good), when
            assert result.failed == [] and result.withheld == []
            assert list(result.rejected) == [bad.id]
            assert "WRONGTYPE" in result.rejected[bad.id], result.rejected
            raw = client.lrange(unique_name, 0, -1)
            assert len(raw) == 50, when
            client.delete(unique_name)
    finally:
        dispatcher.close()
        client.delete(unique_name, bad_queue, f"_kombu.binding.{unique_name}")
        client.delete(f"_kombu.binding.{bad_queue}")
        client.close()


def test_a_missing_rabbitmq_exchange_fails_its_jobs_and_the_rest_go_out(
    amqp_url: str, queues: dict[str, str], redis_url: str
) -> None:
    """Publishing to a missing exchange closes the channel (NOT_FOUND), and
    RabbitMQ drops whatever follows on it: the route fails, the channel is
    reopened, the other jobs are published."""
    app = make_app(amqp_url, queues["routed"])
    app.conf.task_default_queue = queues["default"]
    dispatcher = KombuDispatcher(app, Settings(redis_url=redis_url))
    good = [make_job(RECORD_TASK, (i,)) for i in range(10)]
    missing = [
        make_job(
            RECORD_TASK, ("m",), options={"exchange": "no_such_exchange_h1", "routing_key": "k"}
        )
        for _ in range(2)
    ]
    jobs = [*good[:3], missing[0], *good[3:7], missing[1], *good[7:]]
    try:
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
        assert sorted(result.sent) == sorted(job.id for job in good)
        assert result.failed == [] and sorted(result.rejected) == sorted(j.id for j in missing)
        assert "NOT_FOUND" in result.rejected[missing[0].id]
        with app.connection_for_read() as conn:
            channel = conn.default_channel
            got = []
            while (message := channel.basic_get(queue=queues["default"], no_ack=True)) is not None:
                got.append(message.headers["id"])
        assert sorted(got) == sorted(str(job.id) for job in good)
    finally:
        dispatcher.close()
        delete_queues(app, list(queues.values()), redis_url)


def test_the_engine_sends_a_batch_around_a_job_redis_refuses_until_that_job_is_dead(
    settings: Settings, redis_url: str, unique_name: str
) -> None:
    """Defect 1 end to end (real PostgreSQL and Redis): 50 good jobs claimed
    with one whose queue name is a Redis string go out; the bad one counts
    an attempt per pass with the reason, and ends dead."""
    from celery_sched.leader import Engine
    from celery_sched.lease.elector import LeaderElector
    from celery_sched.lease.memory import MemoryLeaseBackend
    from celery_sched.staging.memory import MemoryStaging
    from celery_sched.store.postgres import PostgresJobStore
    from tests.contract.conftest import new_job

    app = make_app(redis_url, unique_name + "_routed")
    app.conf.task_default_queue = unique_name
    bad_queue = unique_name + "_bad"
    client = redis.Redis.from_url(redis_url)
    client.set(bad_queue, "not a list")
    settings = dataclasses.replace(settings, batch_size=100, sweep_interval=0.05)
    store = PostgresJobStore(settings)
    store.migrate()
    now = store.now()
    good = [
        new_job(f"good-{i}", now - dt.timedelta(seconds=10), task=RECORD_TASK, options={})
        for i in range(50)
    ]
    bad = new_job(
        "bad",
        now - dt.timedelta(seconds=20),
        task=RECORD_TASK,
        options={"queue": bad_queue},
        max_attempts=3,
    )
    store.load_jobs([*good, bad])
    elector = LeaderElector(
        MemoryLeaseBackend(),
        shard=0,
        ttl=settings.lease_ttl,
        safety_margin=settings.lease_safety_margin,
        acquire_epoch=store.acquire_epoch,
        holder="engine-test",
    )
    assert elector.try_acquire() is not None
    engine = Engine(
        store=store,
        staging=MemoryStaging(),
        dispatcher=KombuDispatcher(app, settings),
        elector=elector,
        settings=settings,
    )
    try:
        engine.step()
        assert client.llen(unique_name) == 50
        job = store.get("bad")
        assert job is not None and (job.status, job.attempt) == (JobStatus.PENDING, 1)
        assert job.last_error is not None and "WRONGTYPE" in job.last_error
        deadline = time.monotonic() + 10
        while (job := store.get("bad")) is not None and job.status is not JobStatus.DEAD:
            assert time.monotonic() < deadline, job
            time.sleep(engine.step())
        assert job is not None and job.attempt == 3 and job.finished_at is not None
        assert client.llen(unique_name) == 50  # nothing sent twice
        assert store.counts_by_status() == {JobStatus.DISPATCHED: 50, JobStatus.DEAD: 1}
    finally:
        engine.stop()
        store.close()
        client.delete(unique_name, bad_queue, f"_kombu.binding.{unique_name}")
        client.close()


def test_a_task_routes_function_routes_each_job_by_its_arguments(
    redis_url: str, unique_name: str
) -> None:
    """Issue 15, point 6: the router was called with ``()`` and ``{}`` once per
    task name, so every job went where the first one did. It now gets each
    job's arguments and options, as under ``send_task``."""
    region_queues = {region: f"{unique_name}_{region}" for region in ("eu", "us", "ap")}
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any]]] = []

    def by_region(
        name: str, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any], **_: Any
    ) -> dict[str, str] | None:
        if name != RECORD_TASK:
            return None
        calls.append((name, tuple(args), dict(kwargs), dict(options)))
        region = kwargs.get("region", args[0] if args else None)
        if region == "nowhere":
            raise LookupError("no queue for region 'nowhere'")
        return {"queue": region_queues[region]} if region in region_queues else None

    app = make_app(redis_url, unique_name + "_routed")
    app.conf.task_default_queue = unique_name
    app.conf.task_routes = (by_region, {ROUTED_TASK: {"queue": unique_name + "_routed"}})
    regions = ["eu", "us", "ap", "us", "eu", "ap", "eu"]
    jobs = [make_job(RECORD_TASK, (region, i)) for i, region in enumerate(regions)]
    by_kwarg = make_job(RECORD_TASK, (), {"region": "ap"}, options={"priority": 3})
    unknown = make_job(RECORD_TASK, ("mars",))  # the router has no answer: default queue
    failing = make_job(RECORD_TASK, ("nowhere",))
    routed = make_job(ROUTED_TASK, ("by name",))  # a dict route, cached per task name
    dispatcher = KombuDispatcher(app, Settings(redis_url=redis_url))
    everything = [*jobs[:3], failing, *jobs[3:], by_kwarg, unknown, routed]
    try:
        result = dispatcher.publish(everything, epoch=1, now=dt.datetime.now(dt.UTC))
        assert list(result.rejected) == [failing.id]
        assert "no queue for region 'nowhere'" in result.rejected[failing.id]
        assert result.sent == [job.id for job in everything if job is not failing]
        assert result.failed == [] and result.expired == []

        for region, queue in region_queues.items():
            expected = [job for job, r in zip(jobs, regions, strict=True) if r == region]
            if region == "ap":
                expected.append(by_kwarg)
            got = take(app, queue)
            assert [m.headers["id"] for m in got] == [str(job.id) for job in expected], region
            assert {m.delivery_info["routing_key"] for m in got} == {queue}
        assert [m.headers["id"] for m in take(app, unique_name)] == [str(unknown.id)]
        assert [m.headers["id"] for m in take(app, unique_name + "_routed")] == [str(routed.id)]
        # What send_task gives a router: the job's arguments and options.
        assert ("dispatch_app.record", (), {"region": "ap"}, {"priority": 3}) in calls
        assert (RECORD_TASK, ("eu", 0), {}, {}) in calls
    finally:
        dispatcher.close()
        queues = [*region_queues.values(), unique_name, unique_name + "_routed"]
        delete_queues(app, queues, redis_url)


@pytest.mark.parametrize("path", ["direct", "kombu"])
def test_the_options_a_task_declares_reach_the_message(
    broker: str, publisher_app: Celery, queues: dict[str, str], path: str
) -> None:
    """Issue 15, point 4: ``@app.task(time_limit=5, soft_time_limit=3)`` sent
    no ``timelimit`` and ``@app.task(expires=20)`` no ``expires``. Both paths
    of each broker: Redis's own LPUSH or RabbitMQ's own basic_publish
    ("direct"), and Kombu's producer ("kombu")."""
    app = publisher_app

    @app.task(name="dispatch_app.limited", shared=False, time_limit=5, soft_time_limit=3)
    def limited(*args: Any) -> None:
        """Declares time limits."""

    @app.task(name="dispatch_app.expiring", shared=False, expires=20)
    def expiring(*args: Any) -> None:
        """Declares an expiry."""

    mode = "auto" if path == "direct" else "off"
    dispatcher = KombuDispatcher(app, Settings(hostname="celery_sched@test", fast_publish=mode))
    now = dt.datetime.now(dt.UTC)
    long_ago = now - dt.timedelta(minutes=10)
    declared = make_job("dispatch_app.limited", (1,))
    own = make_job("dispatch_app.limited", (2,), options={"soft_time_limit": 1})
    periodic = make_job("dispatch_app.expiring", (3,), due_at=long_ago, schedule_id=4)
    scheduled = make_job(RECORD_TASK, (4,), options={"expires": 60.0}, schedule_id=5)
    jobs = [declared, own, periodic, scheduled]
    try:
        result = dispatcher.publish(jobs, epoch=1, now=now)
    finally:
        dispatcher.close()
    assert result.sent == [job.id for job in jobs]
    assert (dispatcher.publish_path is PublishPath.KOMBU) == (path == "kombu")

    got = {m.headers["id"]: m for m in take(app, queues["default"])}
    assert list(got) == [str(job.id) for job in jobs]
    assert got[str(declared.id)].headers["timelimit"] == [5, 3]
    assert got[str(own.id)].headers["timelimit"] == [5, 1]
    assert got[str(declared.id)].headers["expires"] is None
    for job, seconds in ((periodic, 20), (scheduled, 60)):
        message = got[str(job.id)]
        assert message.headers["expires"] == (now + dt.timedelta(seconds=seconds)).isoformat()
        assert message.headers["timelimit"] == [None, None]
        # The broker's TTL says the same (RabbitMQ drops the message then).
        assert message.properties["expiration"] == str(seconds * 1000)


@pytest.mark.parametrize(
    ("fast_publish", "events"),
    [("auto", None), ("off", None), ("auto", "fast"), ("auto", "kombu"), ("off", "kombu")],
)
def test_rabbitmq_nacks_release_exactly_the_refused_jobs(
    amqp_url: str,
    unique_name: str,
    fast_publish: str,
    events: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With publisher confirms (the default), a message RabbitMQ nacks (a
    queue full with ``x-overflow: reject-publish``) is not sent: its job is
    reported failed (released), and only the confirmed ones count as sent;
    also with task-sent events interleaved on the channel, written by the
    fast path or by Celery's event dispatcher."""
    name = f"celery_sched_nack_{unique_name}"
    app = Celery("nack_test", broker=amqp_url)
    app.conf.task_send_sent_event = events is not None
    if events == "kombu":
        # A sample event that differs sends the events through Kombu.
        original = sent_events.AmqpSentEvents.body
        monkeypatch.setattr(
            sent_events.AmqpSentEvents, "body", lambda self, *a: original(self, *a) + b" "
        )
    app.conf.task_queues = [
        Queue(name, queue_arguments={"x-max-length": 7, "x-overflow": "reject-publish"})
    ]
    settings = Settings(hostname="celery_sched@nack-test", fast_publish=fast_publish)
    assert settings.publish_confirms
    dispatcher = KombuDispatcher(app, settings, chunk=4)
    jobs = [make_job(RECORD_TASK, (i,), options={"queue": name}) for i in range(12)]
    try:
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
        expected_path = PublishPath.AMQP if fast_publish == "auto" else PublishPath.KOMBU
        assert dispatcher.publish_path is expected_path
        if events is not None:
            expected_events = PublishPath.AMQP if events == "fast" else PublishPath.KOMBU
            assert dispatcher.sent_events_path is expected_events
        assert result.sent == [job.id for job in jobs[:7]]
        assert result.failed == [job.id for job in jobs[7:]]
        assert not result.rejected and not result.withheld
        got = [message.headers["id"] for message in take(app, name)]
        assert got == [str(job.id) for job in jobs[:7]]
    finally:
        dispatcher.close()
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(name)
