"""The fault tests' cluster of ``celery_sched.Task`` workers whose evidence
outlives the fault.

:class:`EffectCluster` runs ``tests.e2e.task_app`` (real beats and workers):
each execution of ``tasks.effect`` writes one row to ``effects``, so a key
with two rows ran twice. The evidence goes to a database that the fault
does not touch (``evidence_dsn``; by default the scheduler's own), in a
schema named like the scheduler's.
"""

from __future__ import annotations

import collections
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_sched.client import Client
from celery_sched.errors import CelerySchedError
from celery_sched.settings import Settings
from tests.e2e import task_app
from tests.e2e.harness import Cluster, wait_for


class EffectCluster(Cluster):
    """A :class:`Cluster` of ``tests.e2e.task_app`` with its evidence in ``evidence_dsn``."""

    def __init__(
        self, *, evidence_dsn: str, extra_env: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(
            app="tests.e2e.task_app",
            extra_env={"E2E_PG_DSN": evidence_dsn, **(extra_env or {})},
            **kwargs,
        )
        self.evidence_dsn = evidence_dsn
        with psycopg.connect(evidence_dsn, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"')
            for statement in task_app.TABLES:
                conn.execute(statement.replace("{s}", f'"{self.schema}"'))

    def effects(self) -> collections.Counter[str]:
        """How many times each key's task body ran."""
        with psycopg.connect(self.evidence_dsn, autocommit=True) as conn:
            rows = conn.execute(f'SELECT key FROM "{self.schema}".effects').fetchall()
        return collections.Counter(str(key) for (key,) in rows)

    def wait_effects(self, keys: Iterable[str], *, timeout: float) -> collections.Counter[str]:
        """Wait until every key in ``keys`` ran; return the counts."""
        wanted = set(keys)

        def done() -> collections.Counter[str] | None:
            counts = self.effects()
            return counts if wanted <= set(counts) else None

        try:
            return wait_for(done, timeout=timeout, interval=0.5, what=f"{len(wanted)} jobs to run")  # type: ignore[no-any-return]
        except TimeoutError:
            missing = sorted(wanted - set(self.effects()))
            raise AssertionError(f"{len(missing)} jobs never ran: {missing[:20]}") from None


class ScheduleStream:
    """Schedules ``tasks.effect`` jobs (due 0-2 s later) one every
    ``interval`` seconds on a thread of its own, until :meth:`stop`.

    :attr:`returned` lists, in order, the keys whose ``schedule()`` returned
    (their rows committed); :attr:`failed` the keys whose call raised.
    """

    def __init__(self, cluster: EffectCluster, prefix: str, interval: float = 0.05) -> None:
        self.client = Client(task_app.app, settings=cluster.settings)
        self.queue = cluster.queue
        self.prefix = prefix
        self.interval = interval
        self.returned: list[str] = []
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stream-{prefix}", daemon=True)

    def _run(self) -> None:
        index = 0
        while not self._stop.wait(self.interval):
            index += 1
            key = f"{self.prefix}-{index:05d}"
            try:
                self.client.schedule(
                    "tasks.effect",
                    args=(key,),
                    countdown=(index % 5) * 0.5,
                    key=key,
                    queue=self.queue,
                )
            except CelerySchedError:
                self.failed.append(key)
            else:
                self.returned.append(key)

    def start(self) -> ScheduleStream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        self.client.close()


@pytest.fixture
def make_effect_cluster(
    tmp_path: Path, e2e_settings: Settings
) -> Iterator[Callable[..., EffectCluster]]:
    """``make_effect_cluster(broker_url, settings=None, evidence_dsn=None, **kw)``:
    a migrated schema and an :class:`EffectCluster` on a queue of its own;
    every process it started is stopped afterwards (logs shown on failure)."""
    clusters: list[EffectCluster] = []

    def make(
        broker_url: str,
        settings: Settings | None = None,
        evidence_dsn: str | None = None,
        **kwargs: Any,
    ) -> EffectCluster:
        from celery_sched.backends import build_store

        settings = settings or e2e_settings
        store = build_store(settings)
        store.migrate()
        store.close()
        cluster = EffectCluster(
            tmp_path=tmp_path,
            settings=settings,
            broker_url=broker_url,
            queue="q_" + uuid.uuid4().hex[:10],
            evidence_dsn=evidence_dsn or settings.libpq_conninfo(),
            **kwargs,
        )
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop_all()
        print(cluster.dump_logs())
