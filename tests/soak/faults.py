"""The chaos soak's fault injector and its process roster.

Every fault touches only the soak's own processes and services: its beats
and workers (children of this process), its private ``redis-server``
instances and its own PostgreSQL database. Each injection returns a
:class:`~tests.soak.checker.FaultWindow` (kind, start, end, recovery grace).

:data:`EXTRA_KINDS` need the soak set up for them (``--extra-faults``, see
:class:`Extras`): its database on a private primary with a synchronous
standby (``tests/pg_cluster.py``), each beat reaching the staging Redis
through a loopback address of its own (``tests/netfault.py``), and each
beat's wall clock under libfaketime (``tests/faketime.py``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import redis

from tests.e2e.harness import Cluster, Proc, RedisServer
from tests.faketime import FakeClock, faketime_missing
from tests.netfault import Partition, iptables_missing
from tests.pg_cluster import PgPair, binaries_missing, pg_pair
from tests.soak.checker import FaultWindow

KINDS = (
    "leader_kill",
    "leader_stop",
    "worker_kill",
    "worker_child_kill",
    "staging_restart",
    "broker_restart",
    "pg_terminate",
    "broker_client_kill",
)
#: Kinds that need the soak set up by :class:`Extras` (``--extra-faults``).
EXTRA_KINDS = (
    "pg_failover",
    "redis_partition",
    "clock_jump",
    "broker_queue_delete",
)


class Extras:
    """What :data:`EXTRA_KINDS` need before the soak starts: the database on
    a :class:`~tests.pg_cluster.PgPair` (synchronous: the soak's checker owes
    every committed job a run), a staging Redis listening on one loopback
    address per beat, and one fake clock per beat."""

    def __init__(self, tmp: Path) -> None:
        problems = [p for p in (binaries_missing(), iptables_missing(), faketime_missing()) if p]
        if problems:
            raise RuntimeError("; ".join(problems))
        self.tmp = tmp
        self.pair: PgPair | None = None
        self.clocks: dict[str, FakeClock] = {}

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """The SQLAlchemy URL of the pair's database (``postgres``)."""
        with pg_pair(synchronous=True) as pair:
            self.pair = pair
            yield pair.database_url()

    @staticmethod
    def address(n: int) -> str:
        """Beat ``n``'s own address of the staging Redis."""
        return f"127.0.0.{n + 1}"

    def staging_binds(self, beats: int) -> tuple[str, ...]:
        return ("127.0.0.1", *(self.address(n) for n in range(1, beats + 1)))

    def beat_env(self, n: int, staging: RedisServer) -> dict[str, str]:
        """The environment of beat ``n`` (slot ``beat<n>``)."""
        clock = self.clocks[f"beat{n}"] = FakeClock(self.tmp, f"beat{n}")
        return {"CELERY_SCHED_REDIS_URL": staging.url_at(self.address(n)), **clock.env()}


class Roster:
    """The soak's beats and workers by slot; a dead one is started again in its
    slot, as a supervisor (systemd, Kubernetes) would."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.slots: dict[str, Proc] = {}
        self.roles: dict[str, str] = {}
        self.generation: dict[str, int] = {}
        #: Processes that exited without being killed by a fault.
        self.exits: list[dict[str, Any]] = []

    def add(self, slot: str, role: str, proc: Proc) -> None:
        self.slots[slot] = proc
        self.roles[slot] = role
        self.generation[slot] = 1

    def of_role(self, role: str) -> list[tuple[str, Proc]]:
        return [(slot, proc) for slot, proc in self.slots.items() if self.roles[slot] == role]

    def replace(self, slot: str) -> Proc:
        self.generation[slot] += 1
        proc = self.cluster.respawn(self.slots[slot], f"{slot}-{self.generation[slot]}")
        self.slots[slot] = proc
        return proc

    def supervise(self, now: float) -> None:
        for slot, proc in list(self.slots.items()):
            if not proc.alive():
                lines = proc.output().strip().splitlines()
                self.exits.append(
                    {
                        "proc": proc.name,
                        "rc": proc.popen.returncode,
                        "at": round(now, 1),
                        "last_line": lines[-1][-300:] if lines else "",
                    }
                )
                self.replace(slot)

    def pid_slot(self, pid: int) -> str | None:
        return next((slot for slot, proc in self.slots.items() if proc.pid == pid), None)


def _parent_pid(pid: int) -> int | None:
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    except (OSError, IndexError):
        return None
    return int(fields[1])


class Faults:
    """Seeded faults against one soak."""

    def __init__(
        self,
        *,
        cluster: Cluster,
        roster: Roster,
        staging: RedisServer,
        broker: RedisServer,
        admin_dsn: str,
        database: str,
        rng: random.Random,
        extras: Extras | None = None,
        tracked: bool = True,
    ) -> None:
        self.extras = extras
        self.cluster = cluster
        self.tracked = tracked
        self.roster = roster
        self.staging = staging
        self.broker = broker
        self.admin_dsn = admin_dsn
        self.database = database
        self.rng = rng
        s = cluster.settings
        self.lease_ttl = s.lease_ttl
        # How long after a fault ended jobs coming due may still be late: a
        # takeover takes up to two lease TTLs, a restarted worker or a
        # reconnecting consumer a few seconds. (Jobs already in flight when
        # it hit may take a visibility or heartbeat timeout to come back;
        # they were due before the window's start, see FaultWindow.covers.)
        takeover = 2 * s.lease_ttl + 4
        self.grace = {
            "leader_kill": takeover,
            "leader_stop": takeover,
            "worker_kill": 10.0,
            "worker_child_kill": 10.0,
            "staging_restart": takeover + s.sweep_interval,
            "broker_restart": 10.0,
            "pg_terminate": 5.0,
            "broker_client_kill": 10.0,
            # Connections fail over within the retries; a new standby follows.
            "pg_failover": takeover + 5.0,
            "redis_partition": takeover,
            "clock_jump": 5.0,
            # The deleted messages come back after their visibility timeout.
            "broker_queue_delete": s.visibility_timeout + 2 * s.reconcile_interval,
        }

    def inject(self, kind: str) -> FaultWindow:
        start = time.time()
        detail = getattr(self, kind)()
        return FaultWindow(
            kind=kind, start=start, end=time.time(), grace=self.grace[kind], detail=detail
        )

    # -- the beats --

    def _leader(self) -> tuple[str, Proc] | None:
        with contextlib.suppress(psycopg.Error):
            proc = self.cluster.leader_proc()
            if proc is not None and proc.alive():
                slot = self.roster.pid_slot(proc.pid)
                if slot is not None:
                    return slot, proc
        return None

    def leader_kill(self) -> str:
        found = self._leader()
        if found is None:
            return "skipped: no live leader"
        slot, proc = found
        proc.kill_group()
        self.roster.replace(slot)
        return f"{proc.name} pid {proc.pid}"

    def leader_stop(self) -> str:
        found = self._leader()
        if found is None:
            return "skipped: no live leader"
        _slot, proc = found
        pause = 2 * self.lease_ttl + self.rng.uniform(0.5, 2.5)
        proc.signal(signal.SIGSTOP)
        try:
            time.sleep(pause)
        finally:
            proc.signal(signal.SIGCONT)
        return f"{proc.name} pid {proc.pid} stopped {pause:.1f}s"

    # -- the workers --

    def _busy(self) -> list[tuple[str, int]]:
        """(hostname, pid) of executions running now, newest first."""
        # Untracked workers report nothing, so no row says running: a start
        # within the longest hold of the stream (0.6 s) stands in for it.
        sql = (
            "SELECT r.hostname, r.pid FROM soak_runs r JOIN {s}.jobs j "
            "ON j.id::text = r.job_id WHERE j.status = 'running' "
            "AND r.started > extract(epoch FROM now()) - 5 ORDER BY r.started DESC"
            if self.tracked
            else "SELECT hostname, pid FROM soak_runs "
            "WHERE started > extract(epoch FROM now()) - 0.6 ORDER BY started DESC"
        )
        with contextlib.suppress(psycopg.Error):
            rows = self.cluster.query(sql)
            return [(str(h), int(p)) for h, p in rows]
        return []

    def _wait_busy(self) -> list[tuple[str, int]]:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            busy = self._busy()
            if busy:
                return busy
            time.sleep(0.1)
        return []

    def worker_kill(self) -> str:
        busy = self._wait_busy()
        workers = dict(self.roster.of_role("worker"))
        # The worker's node name is "<slot>.<queue>@host" (see Cluster.start_worker).
        slot = busy[0][0].split(".", 1)[0] if busy else ""
        if slot not in workers:
            slot = self.rng.choice(sorted(workers))
        proc = workers[slot]
        proc.kill_group()
        time.sleep(self.rng.uniform(0.5, 2.0))
        self.roster.replace(slot)
        return f"{proc.name} pid {proc.pid}" + ("" if busy else " (no task seen running)")

    def worker_child_kill(self) -> str:
        parents = {proc.pid for _slot, proc in self.roster.of_role("worker")}
        for _host, pid in self._wait_busy():
            if _parent_pid(pid) in parents:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    return f"pool child pid {pid}"
        return "skipped: no pool child seen running a task"

    # -- the services --

    def staging_restart(self) -> str:
        down = self.rng.uniform(0.5, 2.0)
        self.staging.restart(down_for=down)
        return f"down {down:.1f}s"

    def broker_restart(self) -> str:
        down = self.rng.uniform(0.5, 2.0)
        self.broker.restart(down_for=down)
        return f"down {down:.1f}s"

    def pg_terminate(self) -> str:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                (self.database,),
            ).fetchall()
        return f"{len(rows)} connections"

    def broker_client_kill(self) -> str:
        try:
            with self.broker.client() as client:
                killed = client.client_kill_filter(_type="normal")
        except redis.RedisError as exc:
            return f"failed: {exc}"
        return f"{killed} connections"

    # -- the extra kinds (Extras) --

    def _extras(self) -> Extras:
        assert self.extras is not None, "the extra kinds need the runner's --extra-faults"
        return self.extras

    def pg_failover(self) -> str:
        pair = self._extras().pair
        assert pair is not None
        started = time.monotonic()
        pair.failover()
        promoted = time.monotonic() - started
        # A standby again for the next round (synchronous once streaming).
        pair.rebuild_standby()
        return f"promoted port {pair.primary.port} after {promoted:.1f}s, standby rebuilt"

    def redis_partition(self) -> str:
        found = self._leader()
        if found is None:
            return "skipped: no live leader"
        _slot, proc = found
        address = urllib.parse.urlsplit(proc.env["CELERY_SCHED_REDIS_URL"]).hostname or ""
        cut = 2 * self.lease_ttl + self.rng.uniform(0.5, 2.5)
        with Partition(address, self.staging.port):
            time.sleep(cut)
        return f"{proc.name} ({address}) cut off {cut:.1f}s"

    def clock_jump(self) -> str:
        found = self._leader()
        if found is None:
            return "skipped: no live leader"
        slot, proc = found
        clock = self._extras().clocks[slot]
        ahead = self.rng.uniform(3.0, 6.0)
        clock.shift(3600)
        try:
            time.sleep(ahead)
        finally:
            clock.shift(0)
        # The process reads the clock file at most a second late.
        time.sleep(1.5)
        return f"{proc.name} an hour ahead for {ahead:.1f}s, then back"

    def broker_queue_delete(self) -> str:
        # The workers keep the queue empty (each holds a blocking pop): paused
        # for a moment (their main processes, which fetch), they let messages
        # gather for the DEL to drop.
        workers = [proc for _slot, proc in self.roster.of_role("worker")]
        for proc in workers:
            proc.signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        try:
            with self.broker.client() as client:
                while client.llen(self.cluster.queue) < 2 and time.monotonic() < deadline:
                    time.sleep(0.05)
                deleted = client.pipeline().llen(self.cluster.queue).delete(self.cluster.queue)
                waiting, _ = deleted.execute()
        except redis.RedisError as exc:
            return f"failed: {exc}"
        finally:
            for proc in workers:
                proc.signal(signal.SIGCONT)
        return f"{waiting} messages deleted"
