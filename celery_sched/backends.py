"""The one place that builds concrete backends from settings, and the one
registry of what a Celery app's worker side uses.

Everything else receives interfaces (:mod:`celery_sched.interfaces`), so unit
tests can hand in the in-memory fakes instead. The beat and the client build
their backends with the ``build_*`` functions here; the worker side of an app
(``celery_sched.Task`` executions, status tracking, the delivery fence and
``Task.schedule()``) finds its backends in the app's :class:`WorkerSide`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from celery_sched.errors import ConfigurationError
from celery_sched.settings import Settings

if TYPE_CHECKING:
    from celery_sched.interfaces import (
        Dispatcher,
        JobStore,
        LeaderBoard,
        LeaseBackend,
        Ledger,
        Membership,
        Staging,
    )
    from celery_sched.leader import Engine, EngineStats
    from celery_sched.leader.fleet import Fleet
    from celery_sched.models import ScheduleSpec
    from celery_sched.redisconn import RedisClient


def build_store(settings: Settings) -> JobStore:
    """The PostgreSQL job store (lazy: connects on first use)."""
    from celery_sched.store.postgres import PostgresJobStore

    return PostgresJobStore(settings)


def build_redis(settings: Settings) -> RedisClient:
    """A Redis client for the lease and staging (lazy: connects on first use;
    a Cluster client reads its slot map then)."""
    from celery_sched.redisconn import build_client

    # A Sentinel URL gives a client of the service's current primary.
    return build_client(
        settings.redis_url,
        socket_timeout=max(1.0, settings.lease_ttl / 3),
        socket_connect_timeout=max(1.0, settings.lease_ttl / 3),
        health_check_interval=30,
    )


def build_lease(settings: Settings, client: RedisClient | None = None) -> LeaseBackend:
    from celery_sched.lease.redis import RedisLeaseBackend

    # One lease operation plus its single quick retry must fit well inside
    # the renewal period (ttl/3), so a hung Redis cannot eat a whole period.
    return RedisLeaseBackend(
        client or build_redis(settings),
        prefix=settings.key_prefix,
        op_timeout=settings.lease_ttl / 6,
        legacy_keys=settings.hold_legacy_lease_keys,
    )


def build_staging(settings: Settings, client: RedisClient | None = None) -> Staging:
    from celery_sched.staging.redis import RedisStaging

    return RedisStaging(client or build_redis(settings), prefix=settings.key_prefix)


def build_board(settings: Settings, client: RedisClient | None = None) -> LeaderBoard:
    """The leader board on Redis (who leads each shard; ``sched leader``)."""
    from celery_sched.lease.board import RedisLeaderBoard

    return RedisLeaderBoard(client or build_redis(settings), prefix=settings.key_prefix)


def build_dispatcher(app: Any, settings: Settings) -> Dispatcher:
    from celery_sched.dispatch.kombu import KombuDispatcher

    return KombuDispatcher(app, settings)


def build_ledger(settings: Settings, store: JobStore | None = None) -> Ledger:
    """The PostgreSQL idempotency ledger (lazy: connects on first use).

    Given the PostgreSQL job store of the same settings, the ledger shares
    its connection pool; otherwise it builds (and closes) a store of its own.
    """
    from celery_sched.store.postgres import PostgresJobStore, PostgresLedger

    if isinstance(store, PostgresJobStore) and store.settings == settings:
        return PostgresLedger(store)
    return PostgresLedger(PostgresJobStore(settings), owns_store=True)


def build_leader(
    app: Any,
    settings: Settings,
    *,
    store: JobStore,
    static: Sequence[ScheduleSpec],
    shard: int | None = None,
    shared: SharedParts | None = None,
    stats: EngineStats | None = None,
) -> Engine:
    """Assemble this process's engine for ``shard`` (default: the pinned
    ``settings.shard``, else 0), not yet started.

    ``store`` is the job store the caller opened (and migrated); the elector
    bumps its epochs, and the ledger shares its pool. ``shared`` holds what
    the engines of one beat share (:func:`build_fleet`); without it they are
    built here from ``settings``: the Redis lease, staging and board (one
    client), the broker dispatcher, the idempotency ledger. The planner of
    ``static`` (the code's periodic schedules) is the engine's own. Connects
    to nothing until used. Call :meth:`Engine.start` to compete for the lease.
    """
    from celery_sched.leader import Engine
    from celery_sched.leader.planning import Planner
    from celery_sched.lease.elector import LeaderElector

    owned = shared is None
    parts = SharedParts.build(app, settings, store) if shared is None else shared
    settings = settings.for_shard(settings.engine_shard if shard is None else shard)
    elector = LeaderElector(
        parts.lease,
        shard=settings.engine_shard,
        ttl=settings.lease_ttl,
        safety_margin=settings.lease_safety_margin,
        acquire_epoch=store.acquire_epoch,
        holder=f"{socket.gethostname()}:{os.getpid()}",
        # Twice per renewal period: a shard given to this beat (a dead
        # beat's) is won soon after its lease runs out.
        standby_interval=settings.lease_ttl / 6,
    )
    return Engine(
        store=store,
        staging=parts.staging,
        dispatcher=parts.dispatcher,
        elector=elector,
        settings=settings,
        planner=Planner(store, settings, app=app, static=static),
        ledger=parts.ledger,
        board=parts.board,
        stats=stats,
        owns_dispatcher=owned,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharedParts:
    """What every engine of one beat process shares: one Redis client's lease,
    staging, board and membership, one broker dispatcher (the engines run one
    after another on one thread), one ledger over the store's pool."""

    lease: LeaseBackend
    staging: Staging
    board: LeaderBoard
    membership: Membership
    dispatcher: Dispatcher
    ledger: Ledger

    @classmethod
    def build(cls, app: Any, settings: Settings, store: JobStore) -> SharedParts:
        from celery_sched.lease.membership import RedisMembership

        client = build_redis(settings)
        return cls(
            lease=build_lease(settings, client),
            staging=build_staging(settings, client),
            board=build_board(settings, client),
            membership=RedisMembership(client, prefix=settings.key_prefix),
            dispatcher=build_dispatcher(app, settings),
            ledger=build_ledger(settings, store),
        )


def build_fleet(
    app: Any, settings: Settings, *, store: JobStore, static: Sequence[ScheduleSpec]
) -> Fleet:
    """Assemble this beat process's :class:`~celery_sched.leader.fleet.Fleet`,
    not yet started: an engine for ``settings.shard`` when it is pinned, else
    one per shard the balancing gives this beat (:mod:`celery_sched.leader.fleet`)."""
    from celery_sched.leader.fleet import Fleet

    parts = SharedParts.build(app, settings, store)

    def make_engine(shard: int, stats: EngineStats) -> Engine:
        return build_leader(
            app, settings, store=store, static=static, shard=shard, shared=parts, stats=stats
        )

    return Fleet(
        make_engine=make_engine,
        shards=settings.shards,
        pinned=settings.shard,
        membership=None if settings.shard is not None else parts.membership,
        # (The lease holder name, host:pid, then a part of its own.)
        beat_id=f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}",
        leaders=lambda shards: {
            view.shard: view.holder for view in parts.board.read(range(shards))
        },
        ttl=settings.lease_ttl,
        on_stop=parts.dispatcher.close,
    )


def build_probes(settings: Settings, *, timeout: float) -> dict[str, Callable[[], None]]:
    """The readiness checks of ``settings``' services, by name: each connects
    once (no retries, waiting about ``timeout`` seconds) and raises a
    :class:`~celery_sched.errors.CelerySchedError` when its service does not answer."""
    from celery_sched.staging.redis import probe as probe_redis
    from celery_sched.store.postgres.connection import probe as probe_postgres

    return {
        "postgresql": functools.partial(probe_postgres, settings, timeout=timeout),
        "redis": functools.partial(probe_redis, settings.redis_url, timeout=timeout),
    }


# -- the worker side -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Overrides:
    """Backends handed in for an app's worker side instead of those its
    settings build (tests; ``celery_sched.task.install`` and friends)."""

    settings: Settings | None = None
    store: JobStore | None = None
    ledger: Ledger | None = None
    #: The ``celery_sched.client.Client`` of ``Task.schedule()`` (typed
    #: loosely so that this module imports nothing of the worker side).
    client: object | None = None


_lock = threading.RLock()

_Part = TypeVar("_Part")


class WorkerSide:
    """What the worker side of one Celery app uses in this process.

    The backends are the :attr:`overrides`, or are built from the settings
    on first use: the settings (the app's), the job store, the idempotency
    ledger (sharing the store's connection pool) and the ``Client`` of
    ``Task.schedule()``. The modules of the worker side keep their
    process-local helpers here as well, as *parts* (:meth:`part`), one per
    class, built on first use: the status writer (:mod:`celery_sched.tracking`),
    the delivery fence (:mod:`celery_sched.fence`), the runtime and the
    client of ``celery_sched.Task`` (:mod:`celery_sched.task`). This module
    names none of them, so it imports nothing of the worker side.

    One per app and process (:func:`worker_side`). Threads and connections
    do not survive a fork, so a forked child starts a new side, which keeps
    the overrides, the install flags and the job store (the store opens its
    own connections in each process).
    """

    #: Guards building anything of any side (builds are cheap: backends
    #: connect on first use).
    lock = _lock

    def __init__(
        self,
        app: Any,
        *,
        overrides: Overrides | None = None,
        store: JobStore | None = None,
        installed: frozenset[str] = frozenset(),
    ) -> None:
        self.pid = os.getpid()
        self._app = weakref.ref(app)
        self.overrides = overrides or Overrides()
        #: The modules whose ``install`` ran for the app (:meth:`install`).
        self.installed = set(installed)
        self._settings = self.overrides.settings
        self._store = self.overrides.store if self.overrides.store is not None else store
        self._ledger = self.overrides.ledger
        self._parts: dict[type, object] = {}
        #: The parts an :meth:`override` keeps (see :meth:`part`).
        self._kept: set[type] = set()

    @property
    def app(self) -> Any:
        app = self._app()
        if app is None:  # pragma: no cover - the registry drops a side with its app
            raise RuntimeError("the Celery app of this worker side is gone")
        return app

    @property
    def settings(self) -> Settings:
        """The overriding settings, else the app's (read on first use)."""
        with _lock:
            if self._settings is None:
                self._settings = Settings.from_app(self.app)
            return self._settings

    @property
    def store(self) -> JobStore:
        """The job store, built on first use; shared with forked children."""
        with _lock:
            if self._store is None:
                self._store = build_store(self.settings)
            return self._store

    @property
    def ledger(self) -> Ledger:
        """This process's idempotency ledger, built on first use (it uses the
        store's pool and per-thread connections, which a forked child never shares)."""
        with _lock:
            if self._ledger is None:
                self._ledger = build_ledger(self.settings, self.store)
            return self._ledger

    def part(self, kind: type[_Part], build: Callable[[], _Part], *, keep: bool = False) -> _Part:
        """This side's one ``kind``, made by ``build()`` (under :attr:`lock`)
        the first time it is asked for.

        An :meth:`override` drops every part, to be built again from the new
        backends, except those built with ``keep`` (the status writer keeps
        the reports it holds).
        """
        found = self._parts.get(kind)
        if found is None:
            with _lock:
                found = self._parts.get(kind)
                if found is None:
                    found = self._parts[kind] = build()
                    if keep:
                        self._kept.add(kind)
        return cast(_Part, found)

    def replace_part(self, kind: type[_Part], value: _Part | None) -> None:
        """Make ``value`` this side's ``kind`` (``None``: build it again on next use)."""
        with _lock:
            if value is None:
                self._parts.pop(kind, None)
            else:
                self._parts[kind] = value

    def built(self, kind: type[_Part]) -> _Part | None:
        """This side's ``kind`` if it was built, without building it."""
        return cast("_Part | None", self._parts.get(kind))

    def override(self, **given: Any) -> None:
        """Use the given backends (``settings``, ``store``, ``ledger``,
        ``client``) from now on; ``None`` for one builds it from the settings again.

        What was built from the earlier ones is built again on first use,
        except the status writer, which keeps the reports it holds.
        """
        with _lock:
            before = self.overrides
            after = self.overrides = dataclasses.replace(before, **given)
            self._settings = after.settings
            if after.store is not before.store or after.settings != before.settings:
                self._store = after.store
            self._ledger = after.ledger
            self._parts = {kind: part for kind, part in self._parts.items() if kind in self._kept}

    def install(self, module: str, **given: Any) -> bool:
        """Record that ``module`` installed itself for the app, using the
        backends ``given`` that are not None (see :meth:`override`); True
        the first time, when the module has its signal handlers to connect."""
        with _lock:
            given = {name: value for name, value in given.items() if value is not None}
            if given:
                self.override(**given)
            first = module not in self.installed
            self.installed.add(module)
            return first

    def forked(self) -> WorkerSide:
        """A new side for this app in a child process of this side's."""
        return WorkerSide(
            self.app,
            overrides=self.overrides,
            store=self._store,
            installed=frozenset(self.installed),
        )

    @contextlib.contextmanager
    def plain_transaction(self) -> Iterator[Any]:
        """A transaction on the job store's PostgreSQL database (yields a
        SQLAlchemy ``Connection``); for ``Task.ledger_transaction()`` called
        outside an execution."""
        from celery_sched.store.postgres import PostgresJobStore

        store = self.store
        if not isinstance(store, PostgresJobStore):
            raise ConfigurationError("ledger_transaction() needs the PostgreSQL job store")
        with store.engine.begin() as conn:
            yield conn


_sides: weakref.WeakKeyDictionary[Any, WorkerSide] = weakref.WeakKeyDictionary()


def worker_side(app: Any) -> WorkerSide:
    """The :class:`WorkerSide` of ``app`` in this process (the only registry of them)."""
    side = _sides.get(app)
    if side is not None and side.pid == os.getpid():
        return side
    with _lock:
        side = _sides.get(app)
        if side is None:
            side = _sides[app] = WorkerSide(app)
        elif side.pid != os.getpid():
            side = _sides[app] = side.forked()
        return side


def worker_sides() -> list[WorkerSide]:
    """The worker sides this process made (of apps still alive)."""
    pid = os.getpid()
    with _lock:
        return [side for side in _sides.values() if side.pid == pid]
