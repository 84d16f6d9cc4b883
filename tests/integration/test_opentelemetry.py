"""Issue 15, point 7: OpenTelemetry's Celery instrumentation traces celery_sched's
messages as it traces ``send_task``'s: one publish span per job in the
scheduler, and the worker's run span of that job its child.

The scheduler side is this process (``CeleryInstrumentor`` with an in-memory
exporter); the worker is a real ``celery worker`` subprocess, instrumented too,
writing its spans to a file (``otel_app.py``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from celery_sched.dispatch.fast_path import PublishPath
from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.settings import Settings
from tests.integration.otel_app import TASK, make_app
from tests.integration.test_dispatch_kombu import delete_queues, make_job

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))

#: (broker, celery_sched_fast_publish) -> the path the dispatcher must take.
PATHS = {
    ("redis", "auto"): PublishPath.REDIS,
    ("amqp", "auto"): PublishPath.AMQP,
    ("redis", "off"): PublishPath.KOMBU,
}


@pytest.fixture(params=["redis", "amqp"])
def broker(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """The scheduler process instrumented, its spans kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        yield exporter
    finally:
        instrumentor.uninstrument()


@pytest.fixture
def app(
    request: pytest.FixtureRequest, broker: str, unique_name: str, redis_url: str
) -> Iterator[Celery]:
    """The scheduler's app, current as a scheduler's app is: the
    instrumentation finds the task a publish is for in the current app."""
    url = redis_url if broker == "redis" else str(request.getfixturevalue("amqp_url"))
    app = make_app(url, unique_name)
    from celery import current_app

    previous = current_app._get_current_object()
    app.set_current()
    try:
        yield app
    finally:
        previous.set_current()
        delete_queues(app, [unique_name], redis_url)


def start_worker(broker_url: str, queue: str, spans: Path) -> subprocess.Popen[bytes]:
    env = dict(
        os.environ, OTEL_TEST_BROKER=broker_url, OTEL_TEST_QUEUE=queue, OTEL_TEST_SPANS=str(spans)
    )
    return subprocess.Popen(
        [
            CELERY,
            "-A",
            "tests.integration.otel_app",
            "worker",
            "--pool=solo",
            "-Q",
            queue,
            "-n",
            f"otel-{uuid.uuid4().hex[:6]}@%h",
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


def run_spans(
    worker: subprocess.Popen[bytes], spans: Path, count: int, timeout: float = 60.0
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    found: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if spans.exists():
            lines = spans.read_text(encoding="utf-8").splitlines()
            found = [json.loads(line) for line in lines if line]
            found = [span for span in found if span["kind"] == "CONSUMER"]
            if len(found) >= count:
                break
        assert worker.poll() is None, worker.stderr.read().decode()  # type: ignore[union-attr]
        time.sleep(0.2)
    return found


@pytest.mark.parametrize("fast_publish", ["auto", "off"])
def test_each_jobs_worker_run_span_is_the_child_of_its_publish_span(
    app: Celery,
    broker: str,
    fast_publish: str,
    unique_name: str,
    redis_url: str,
    exporter: InMemorySpanExporter,
    tmp_path: Path,
) -> None:
    jobs = [make_job(TASK, (i,), {"n": i}) for i in range(4)]
    settings = Settings(
        redis_url=redis_url, hostname="celery_sched@otel", fast_publish=fast_publish
    )
    dispatcher = KombuDispatcher(app, settings)
    try:
        result = dispatcher.publish(jobs, epoch=1, now=dt.datetime.now(dt.UTC))
    finally:
        dispatcher.close()
    assert result.sent == [job.id for job in jobs]
    assert dispatcher.publish_path is PATHS.get((broker, fast_publish), PublishPath.KOMBU)

    published = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.PRODUCER]
    by_task = {(span.attributes or {}).get("messaging.message.id"): span for span in published}
    assert len(published) == len(jobs)
    assert set(by_task) == {str(job.id) for job in jobs}
    # Each message its own trace: no publish span is another's parent.
    assert all(span.parent is None for span in published)
    assert len({span.context.trace_id for span in published}) == len(jobs)

    spans = tmp_path / "worker_spans.jsonl"
    worker = start_worker(app.conf.broker_url, unique_name, spans)
    try:
        runs = run_spans(worker, spans, len(jobs))
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
    assert sorted(run["task_id"] for run in runs) == sorted(str(job.id) for job in jobs)
    for run in runs:
        publish = by_task[run["task_id"]].context
        assert run["name"] == f"run/{TASK}"
        assert run["trace_id"] == f"{publish.trace_id:032x}"
        assert run["parent_span_id"] == f"{publish.span_id:016x}"
