"""Issue #31: RabbitMQ restarted while the dispatcher publishes with confirms.

With publisher confirms (the default) a job counts as sent only once
RabbitMQ confirmed its chunk, so a restart of the broker mid-dispatch must
lose nothing: every job reported sent is in its (durable) queue afterwards,
every other job is reported failed (a beat releases those and claims them
again, as the loop below does), and the only duplicates are messages of the
one chunk in flight when the broker went down, published again after it.

The shared RabbitMQ is stopped with ``rabbitmqctl stop_app`` and started
again at once (``try``/``finally``: the test always leaves it running).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import subprocess
import threading
import time
import uuid
from typing import Any

import pytest
from celery import Celery

from celery_sched.dispatch.kombu import KombuDispatcher
from celery_sched.settings import Settings
from tests.integration.test_dispatch_kombu import make_job

pytestmark = pytest.mark.slow

CHUNK = 200
TASK = "tests.amqp_restart.noop"


def _rabbitmqctl(command: str) -> None:
    subprocess.run(["rabbitmqctl", command], check=True, capture_output=True, timeout=120)


def _restart_rabbitmq() -> None:
    try:
        _rabbitmqctl("stop_app")
        time.sleep(1.0)
    finally:
        _rabbitmqctl("start_app")
        _rabbitmqctl("await_startup")


def _drain(app: Celery, queue: str) -> collections.Counter[str]:
    """Every message in ``queue``, counted by task id; the queue is deleted."""
    counts: collections.Counter[str] = collections.Counter()

    def on_message(message: Any) -> None:
        counts[message.headers["id"]] += 1

    with app.connection_for_write() as conn:
        channel = conn.default_channel
        channel.basic_consume(queue, no_ack=True, callback=on_message)
        while True:
            try:
                conn.drain_events(timeout=2)
            except TimeoutError:
                break
        channel.queue_delete(queue)
    return counts


def test_a_rabbitmq_restart_mid_dispatch_loses_nothing(
    amqp_url: str, unique_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = Celery("amqp_restart", broker=amqp_url)
    app.conf.task_send_sent_event = False
    queue = f"celery_sched_restart_{unique_name}"
    settings = dataclasses.replace(
        Settings(hostname="celery_sched@restart-test"),
        connect_retries=3,
        retry_backoff=0.1,
        publish_confirm_timeout=5.0,
    )
    assert settings.publish_confirms  # the default
    dispatcher = KombuDispatcher(app, settings, chunk=CHUNK)
    now = dt.datetime.now(dt.UTC)

    restarter: threading.Thread | None = None
    restart_errors: list[BaseException] = []
    chunks = 0

    def restart() -> None:
        try:
            _restart_rabbitmq()
        except BaseException as exc:  # re-raised in the test's thread
            restart_errors.append(exc)

    def allowed() -> bool:
        # Full speed: RabbitMQ closes the connection while chunks are on the wire.
        nonlocal chunks, restarter
        chunks += 1
        if chunks == 3:
            restarter = threading.Thread(target=restart, daemon=True)
            restarter.start()
        return True

    made: list[uuid.UUID] = []
    sent: collections.Counter[uuid.UUID] = collections.Counter()
    failed_calls = 0
    retry: list[Any] = []
    try:
        deadline = time.monotonic() + 180
        after = 0
        while time.monotonic() < deadline:
            batch = retry or [
                make_job(TASK, (len(made) + i,), options={"queue": queue}) for i in range(200)
            ]
            if not retry:
                made.extend(job.id for job in batch)
            result = dispatcher.publish(batch, epoch=1, now=now, may_publish=allowed)
            assert not result.rejected and not result.expired and not result.withheld
            assert sorted(result.sent + result.failed) == sorted(job.id for job in batch)
            sent.update(result.sent)
            # A beat releases the failed jobs and claims them again later.
            failed_ids = set(result.failed)
            retry = [job for job in batch if job.id in failed_ids]
            if retry:
                failed_calls += 1
                time.sleep(0.5)
            if restarter is not None and not restarter.is_alive():
                after += 1
                if after >= 3 and not retry:
                    break
        else:
            pytest.fail("the dispatch did not recover from the restart within 180 s")
    finally:
        if restarter is not None:
            restarter.join(timeout=240)
        dispatcher.close()
        # Whatever happened, RabbitMQ is left running.
        if subprocess.run(
            ["rabbitmqctl", "await_startup"], capture_output=True, timeout=120
        ).returncode:
            _rabbitmqctl("start_app")
            _rabbitmqctl("await_startup")
    assert not restart_errors, restart_errors
    # The restart broke a publish in flight (retried at once, or failed and
    # claimed again by the loop).
    interrupted = [r for r in caplog.records if r.name == "celery_sched.retry"]
    assert interrupted or failed_calls, "the restart never interrupted a publish"

    received = _drain(app, queue)
    print(f"{len(made)} jobs, {sum(received.values())} messages, failed calls {failed_calls}")
    # Each job was reported sent exactly once, in the end.
    assert set(sent) == set(made) and all(n == 1 for n in sent.values())
    # Nothing lost: every job is in the queue.
    missing = [job_id for job_id in made if received[str(job_id)] == 0]
    assert not missing, f"{len(missing)} of {len(made)} confirmed jobs lost"
    assert set(received) == {str(job_id) for job_id in made}
    # At most the chunk unconfirmed when the broker went down is sent again.
    duplicates = sum(n - 1 for n in received.values())
    assert duplicates <= CHUNK, duplicates
