"""Redis topologies of a test's own, on free loopback ports in a temp dir.

:class:`SentinelSet` runs one primary, one replica (``replicaof``) and three
sentinels (quorum 2, ``down-after-milliseconds`` 1000, ``failover-timeout``
3000), all real ``redis-server`` processes. :func:`sentinel_set` starts one
and stops every process afterwards. :class:`ClusterSet` runs a Redis Cluster
of three masters (``redis-cli --cluster create``), with no replica or one per
master; :func:`cluster_set` starts one and stops it. Tests fail, never skip, when
``redis-server`` (or ``redis-cli``) is missing: a green run must mean
Sentinel and Cluster were exercised.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis

from tests.e2e.harness import Proc, free_port, spawn, wait_for

SERVICE = "celery_sched_test"
QUORUM = 2
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 3000
#: Masters of a test Cluster (the fewest ``redis-cli --cluster create`` takes).
CLUSTER_MASTERS = 3
#: ``cluster-node-timeout`` of a test Cluster: a master silent this long is
#: failing, and its replica (if any) takes over about a second later.
NODE_TIMEOUT_MS = 2000


def redis_server() -> str:
    """The ``redis-server`` binary; fails the test when there is none."""
    found = shutil.which("redis-server")
    if found is None:
        ci = " (CI is set)" if os.environ.get("CI") else ""
        pytest.fail(f"redis-server is not installed{ci}; the Sentinel tests need it (see README)")
    return found


def redis_cli() -> str:
    """The ``redis-cli`` binary (it creates the Cluster); fails the test when there is none."""
    found = shutil.which("redis-cli")
    if found is None:
        ci = " (CI is set)" if os.environ.get("CI") else ""
        pytest.fail(f"redis-cli is not installed{ci}; the Cluster tests need it (see README)")
    return found


def _client(port: int, timeout: float = 1.0) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1", port=port, socket_timeout=timeout, socket_connect_timeout=timeout
    )


def _answers(port: int) -> bool:
    try:
        with _client(port) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


class _Topology:
    """Redis processes started by a test, each under a name; :meth:`stop`
    ends them (in :meth:`stop_order`), :meth:`logs` shows what they said."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.server = redis_server()
        self.procs: dict[str, Proc] = {}

    def start(self) -> None:
        raise NotImplementedError

    def stop_order(self) -> list[str]:
        return list(self.procs)

    def stop(self) -> None:
        for name in self.stop_order():
            with contextlib.suppress(Exception):
                self.procs[name].stop(5)

    def logs(self) -> str:
        return "\n".join(
            f"===== {name} (rc {proc.popen.poll()})\n{proc.tail(3000)}"
            for name, proc in self.procs.items()
        )


_T = TypeVar("_T", bound=_Topology)


@contextlib.contextmanager
def _started(topology: _T) -> Iterator[_T]:
    """``topology`` started; stopped afterwards, its logs printed (pytest
    shows them only for a failed test)."""
    try:
        topology.start()
        yield topology
    finally:
        topology.stop()
        print(topology.logs())


class SentinelSet(_Topology):
    """A primary, a replica and three sentinels watching them as :data:`SERVICE`."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.primary_port, self.replica_port = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(3)]

    # -- URLs ---------------------------------------------------------------

    @property
    def url(self) -> str:
        """The preferred form: ``redis+sentinel://s1,s2,s3/<service>/0``."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    @property
    def kombu_url(self) -> str:
        """Celery/Kombu's form: ``sentinel://s1;sentinel://s2;...?master_name=<service>``."""
        urls = ";".join(f"sentinel://127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"{urls}?master_name={SERVICE}"

    # -- processes ----------------------------------------------------------

    def start(self) -> None:
        self._data_node("primary", self.primary_port)
        self._data_node(
            "replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.primary_port)
        )
        wait_for(self._replica_in_sync, timeout=20, interval=0.05, what="the replica to sync")
        for index, port in enumerate(self.sentinel_ports):
            self._sentinel(index, port)
        wait_for(self._sentinels_ready, timeout=30, interval=0.1, what="the sentinels to agree")

    def _data_node(self, name: str, port: int, *extra: str) -> None:
        node_dir = self.dir / name
        node_dir.mkdir(exist_ok=True)
        args = [
            self.server,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(node_dir),
            *extra,
        ]  # fmt: skip
        self.procs[name] = spawn(name, args, log_dir=self.dir, env=dict(os.environ))
        wait_for(lambda: _answers(port), timeout=20, interval=0.05, what=f"{name} to answer PING")

    def _sentinel(self, index: int, port: int) -> None:
        # Sentinel rewrites its configuration file, so each gets its own.
        conf = self.dir / f"sentinel-{index}.conf"
        conf.write_text(
            f"port {port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary_port} {QUORUM}\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        name = f"sentinel-{index}"
        self.procs[name] = spawn(
            name, [self.server, str(conf), "--sentinel"], log_dir=self.dir, env=dict(os.environ)
        )
        wait_for(lambda: _answers(port), timeout=20, interval=0.05, what=f"{name} to answer PING")

    def _replica_in_sync(self) -> bool:
        try:
            with _client(self.replica_port) as client:
                info = client.info("replication")
        except redis.RedisError:
            return False
        return info.get("master_link_status") == "up"

    def _sentinels_ready(self) -> bool:
        """Every sentinel sees the other two and the replica."""
        try:
            for port in self.sentinel_ports:
                with _client(port) as client:
                    state = client.sentinel_master(SERVICE)
                    replicas = client.sentinel_slaves(SERVICE)
                if state["num-other-sentinels"] < 2 or not any(
                    not (r["is_sdown"] or r["is_odown"]) for r in replicas
                ):
                    return False
        except redis.RedisError:
            return False
        return True

    # -- faults and questions ------------------------------------------------

    def primary_address(self) -> tuple[str, int] | None:
        """Where the sentinels (a majority that answers) say the primary is."""
        votes: dict[tuple[str, int], int] = {}
        for port in self.sentinel_ports:
            try:
                with _client(port) as client:
                    reply = client.sentinel_get_master_addr_by_name(SERVICE)
            except redis.RedisError:
                continue
            if not reply:
                continue
            host, master_port = reply
            address = (host.decode() if isinstance(host, bytes) else str(host), int(master_port))
            votes[address] = votes.get(address, 0) + 1
        winners = [address for address, count in votes.items() if count >= QUORUM]
        return winners[0] if winners else None

    def kill_primary(self) -> None:
        """kill -9 the current primary process."""
        self.procs["primary"].kill_group()

    def client(self, port: int) -> redis.Redis:
        return _client(port, timeout=5)

    def stop_order(self) -> list[str]:
        # Sentinels first, so that none reconfigures what is being stopped.
        return sorted(self.procs, key=lambda n: not n.startswith("sentinel"))


@contextlib.contextmanager
def sentinel_set(directory: Path) -> Iterator[SentinelSet]:
    """A started :class:`SentinelSet` in ``directory``; every process is
    stopped afterwards, and the logs are printed (pytest shows them only
    for a failed test)."""
    with _started(SentinelSet(directory)) as topology:
        yield topology


#: A Cluster node also listens on its port + 10000 (the cluster bus).
_BUS_OFFSET = 10000


def _cluster_port() -> int:
    """A free loopback port whose bus port (+10000, at most 65535) is free too."""
    for _ in range(1000):
        port = free_port()
        if port + _BUS_OFFSET > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + _BUS_OFFSET))
            except OSError:
                continue
        return port
    raise AssertionError("no free loopback port pair for a Cluster node")


class ClusterSet(_Topology):
    """A Redis Cluster of :data:`CLUSTER_MASTERS` masters and ``replicas``
    replicas of each (0 or 1); nodes time out after ``node_timeout_ms``."""

    def __init__(
        self, directory: Path, *, replicas: int = 0, node_timeout_ms: int = NODE_TIMEOUT_MS
    ) -> None:
        super().__init__(directory)
        self.cli = redis_cli()
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        #: Every node's port; ``redis-cli --cluster create`` makes the first
        #: :data:`CLUSTER_MASTERS` masters and the rest their replicas.
        self.all_ports: list[int] = []
        while len(self.all_ports) < CLUSTER_MASTERS * (1 + replicas):
            port = _cluster_port()
            if port not in self.all_ports:
                self.all_ports.append(port)
        #: The masters' ports, as created (a failover changes who is master).
        self.ports = self.all_ports[:CLUSTER_MASTERS]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:P1,127.0.0.1:P2,.../`` (every first master a seed)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports) + "/"

    def start(self) -> None:
        for port in self.all_ports:
            self._node(port)
        subprocess.run(
            [
                self.cli, "--cluster", "create",
                *(f"127.0.0.1:{port}" for port in self.all_ports),
                "--cluster-replicas", str(self.replicas), "--cluster-yes",
            ],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        wait_for(self._ready, timeout=30, interval=0.1, what="cluster_state:ok on every node")

    def _node(self, port: int) -> None:
        name = f"node-{port}"
        node_dir = self.dir / name
        node_dir.mkdir(exist_ok=True)
        args = [
            self.server,
            "--port", str(port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(node_dir / "nodes.conf"),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(node_dir),
        ]  # fmt: skip
        self.procs[name] = spawn(name, args, log_dir=self.dir, env=dict(os.environ))
        wait_for(lambda: _answers(port), timeout=20, interval=0.05, what=f"{name} to answer PING")

    def _ready(self) -> bool:
        """Every node reports ``cluster_state:ok`` and knows every node, and
        every replica is in sync with its master (so it can take over)."""
        try:
            for port in self.all_ports:
                with _client(port) as client:
                    fields = _cluster_info(client)
                    if fields.get("cluster_state") != "ok":
                        return False
                    if int(fields.get("cluster_known_nodes", 0)) != len(self.all_ports):
                        return False
                    if port in self.ports:
                        continue
                    info = client.info("replication")
                    if info.get("role") != "slave" or info.get("master_link_status") != "up":
                        return False
        except redis.RedisError:
            return False
        return True

    def client(self, port: int) -> redis.Redis:
        """A plain client of the one node at ``port`` (no redirections)."""
        return _client(port, timeout=5)

    def replica_client(self, port: int) -> redis.Redis:
        """A client of the replica at ``port`` that may read its keys (one
        connection, in ``READONLY`` mode; a replica redirects it otherwise)."""
        client = redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=5, single_connection_client=True
        )
        client.execute_command("READONLY")
        return client

    def _slots(self) -> list[Any]:
        """``CLUSTER SLOTS`` as the first node that answers tells it."""
        for port in self.all_ports:
            if not self.alive(port):
                continue
            try:
                with _client(port) as client:
                    return list(client.execute_command("CLUSTER", "SLOTS"))
            except redis.RedisError:
                continue
        raise AssertionError("no Cluster node answers CLUSTER SLOTS")

    def port_of_slot(self, slot: int) -> int:
        """The port of the master serving ``slot`` (from CLUSTER SLOTS)."""
        for entry in self._slots():
            start, end, master = entry[0], entry[1], entry[2]
            if int(start) <= slot <= int(end):
                return int(master[1])
        raise AssertionError(f"no master serves slot {slot}")

    def replica_of(self, master_port: int) -> int:
        """The port of a replica of the master at ``master_port``."""
        with _client(master_port) as client:
            info = client.info("replication")
        for name, value in info.items():
            if name.startswith("slave") and isinstance(value, dict):
                return int(value["port"])
        raise AssertionError(f"the master at {master_port} has no replica")

    def role(self, port: int) -> str:
        """``master`` or ``slave``, as the node at ``port`` says."""
        with _client(port) as client:
            return str(client.info("replication")["role"])

    def alive(self, port: int) -> bool:
        return self.procs[f"node-{port}"].alive()

    def kill(self, port: int) -> None:
        """kill -9 the node at ``port``."""
        self.procs[f"node-{port}"].kill_group()

    def spread_prefix(self, base: str, shards: int = CLUSTER_MASTERS) -> str:
        """A key prefix starting with ``base`` whose shards ``0..shards-1``
        live on as many different masters as there are (asserted by the
        caller with ``CLUSTER KEYSLOT``), so a test spans the Cluster."""
        from redis.crc import key_slot

        from celery_sched.rediskeys import shard_keys

        want = min(shards, len(self.ports))
        for attempt in range(1000):
            prefix = f"{base}{attempt}"
            masters = {
                self.port_of_slot(key_slot(shard_keys(prefix, shard).lease.encode()))
                for shard in range(shards)
            }
            if len(masters) == want:
                return prefix
        raise AssertionError(f"no prefix under {base!r} spreads {shards} shards")


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    info = client.execute_command("CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


@contextlib.contextmanager
def cluster_set(directory: Path, *, replicas: int = 0) -> Iterator[ClusterSet]:
    """A started :class:`ClusterSet` in ``directory`` (``replicas`` per
    master); every node is stopped afterwards, and the logs are printed
    (shown only for a failed test)."""
    with _started(ClusterSet(directory, replicas=replicas)) as topology:
        yield topology


@contextlib.contextmanager
def unstarted_cluster_set(directory: Path) -> Iterator[ClusterSet]:
    """A :class:`ClusterSet` in ``directory`` whose ports are chosen but
    whose nodes are not started (call :meth:`ClusterSet.start`); whatever
    was started is stopped afterwards, and the logs are printed."""
    topology = ClusterSet(directory)
    try:
        yield topology
    finally:
        topology.stop()
        print(topology.logs())


def masters_of(client: Any, keys: list[str]) -> set[int]:
    """The ports of the masters a Cluster ``client`` sends ``keys`` to, by
    each key's ``CLUSTER KEYSLOT`` as the server computes it."""
    ports = set()
    for key in keys:
        slot = int(client.cluster_keyslot(key))
        assert slot == client.keyslot(key)  # redis-py routes by the server's slot
        ports.add(int(client.nodes_manager.get_node_from_slot(slot).port))
    return ports
