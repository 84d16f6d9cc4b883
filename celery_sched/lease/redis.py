"""The leader lease in Redis: one key per shard, holding the leader's token.

* acquire: ``acquire.lua``, ``SET NX PX`` on every lease key or on none;
* renew: ``renew.lua``, compare-and-PEXPIRE;
* release: ``release.lua``, compare-and-DEL.

The key is the shard's hash-tagged ``{<prefix>:<shard>}:lease``
(:mod:`celery_sched.rediskeys`). With ``legacy_keys`` a beat also holds the
key of beats before hash tags, ``<prefix>:lease:<shard>``, with the same
token, in the same scripts: while old and new beats run side by side an old
beat (which only knows the legacy key) finds it taken whenever a new beat
leads, and a new beat finds the legacy key taken whenever an old one leads.
Turn it off (``celery_sched_legacy_lease_keys``) only once no old beat runs:
from then on old beats are no longer excluded. On a Redis Cluster the two
keys hash to different slots, so no script could take both; no old beat ever
ran on a Cluster, and the setting is refused there.

Never GET followed by EXPIRE/DEL: between the two another process may have
taken the lease. Redis's own clock decides expiry.

A lease operation must answer well within ``ttl / 3`` (the renewal period),
or the leader's local deadline passes while it is still waiting. So this
backend talks to Redis through its own small connection pool, cloned from the
given client's settings but with redis-py's built-in retries turned off (by
default redis-py retries a failed command ten times with backoff), and retries
a lost connection once, quickly, itself. Everything else fails fast as
:class:`~celery_sched.errors.LeaseUnavailable`; the elector then steps down
and tries again on its next tick.

Behind Redis Sentinel (:mod:`celery_sched.redisconn`) the key lives on the
current primary. Replication is asynchronous, so a failover can lose the key
(or its last renewal): another beat may then win the lease while the old
leader still trusts its own until its next renewal fails (at most ``ttl/3``
later; the renewal finds the key gone or holding another token). The lease
alone cannot prevent that overlap; the PostgreSQL epoch does: the newcomer's
acquisition bumps the shard's epoch, and every claim compares epochs, so the
old leader claims nothing more (:class:`~celery_sched.errors.StaleEpoch`) and
steps down. What it had already claimed is published once, by it.
"""

from __future__ import annotations

import importlib.resources
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from celery_sched.errors import CelerySchedError, LeaseError, LeaseUnavailable
from celery_sched.interfaces import LeaseBackend
from celery_sched.redisconn import clone_client, describe, is_cluster_client
from celery_sched.rediskeys import check_prefix, legacy_lease_key, shard_keys
from celery_sched.retry import call_with_retry

if TYPE_CHECKING:
    from celery_sched.redisconn import RedisClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: One quick retry of a dropped connection (a server restart, an idle
#: connection closed by a proxy); anything slower than that is an outage.
_ATTEMPTS = 2
_RETRY_DELAY = 0.05

#: Errors that mean "Redis cannot be reached or cannot write right now".
#: READONLY comes from a replica promoted away from us after a failover;
#: a Cluster client raises its own error when no node can be reached, and a
#: Cluster answers CLUSTERDOWN while a master is failing or before it formed.
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.ReadOnlyError,
    redis.exceptions.RedisClusterUnreachableError,
    redis.exceptions.ClusterDownError,
)

#: Every error the driver raises: redis-py's Cluster client raises some
#: (no reachable node, no node for a slot) that are not ``RedisError``.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    redis.RedisError,
    redis.exceptions.RedisClusterException,
)


def load_script(name: str) -> str:
    """The text of ``celery_sched/lease/lua/<name>.lua``."""
    return (
        importlib.resources.files("celery_sched.lease")
        .joinpath("lua")
        .joinpath(f"{name}.lua")
        .read_text(encoding="utf-8")
    )


def lease_key(prefix: str, shard: int) -> str:
    """The Redis key holding shard ``shard``'s lease under ``prefix``."""
    return shard_keys(prefix, shard).lease


def ttl_to_ms(ttl: float) -> int:
    """``ttl`` seconds as whole milliseconds (at least 1); refuse ``ttl <= 0``."""
    if ttl <= 0:
        raise ValueError(f"lease ttl must be positive, got {ttl!r}")
    return max(1, round(ttl * 1000))


def translate(exc: BaseException) -> CelerySchedError:
    """A Redis error as the lease's own error."""
    if isinstance(exc, _UNAVAILABLE):
        return LeaseUnavailable(f"the lease backend (Redis) cannot be reached: {exc}")
    return LeaseError(f"the leader lease failed in Redis: {exc}")


def _lease_client(client: RedisClient, op_timeout: float | None) -> RedisClient:
    """A client sharing ``client``'s settings but not its retry policy (for a
    Sentinel client: the same sentinels and service, on a pool of its own;
    for a Cluster client: the same seeds, no cluster-level retries)."""
    overrides: dict[str, Any] = {"retry": Retry(NoBackoff(), 0)}
    if op_timeout is not None:
        overrides["socket_timeout"] = op_timeout
        overrides["socket_connect_timeout"] = op_timeout
    # The elector thread is the only steady user; a few connections cover the
    # loop's occasional holder()/release() calls.
    return clone_client(client, max_connections=8, **overrides)


class RedisLeaseBackend(LeaseBackend):
    """:class:`~celery_sched.interfaces.LeaseBackend` on a Redis key per shard.

    The key of shard ``n`` is ``{prefix:n}:lease``, plus ``prefix:lease:n``
    with ``legacy_keys`` (see the module's docstring); their value is the
    holder's token. ``op_timeout`` (seconds) bounds each socket read and
    connect; leave it ``None`` to keep ``client``'s own timeouts, and size it
    to about ``ttl / 6`` so one retry still fits in the renewal period.
    ``legacy_keys`` on a Cluster client raises :class:`ValueError`.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str,
        op_timeout: float | None = None,
        legacy_keys: bool = False,
    ) -> None:
        check_prefix(prefix)
        if legacy_keys and is_cluster_client(client):
            raise ValueError(
                "legacy lease keys cannot be held on a Redis Cluster (the two keys "
                "are in different slots; no beat before hash tags ran on a Cluster)"
            )
        self._prefix = prefix
        self._legacy = legacy_keys
        self._client = _lease_client(client, op_timeout)
        self._where = describe(client)
        self._acquire: Script = self._client.register_script(load_script("acquire"))
        self._renew: Script = self._client.register_script(load_script("renew"))
        self._release: Script = self._client.register_script(load_script("release"))

    def key(self, shard: int) -> str:
        """The Redis key holding shard ``shard``'s lease."""
        return lease_key(self._prefix, shard)

    def keys(self, shard: int) -> list[str]:
        """Every key this backend holds for shard ``shard``'s lease (the
        hash-tagged one first, then the legacy one if held too)."""
        keys = [self.key(shard)]
        if self._legacy:
            keys.append(legacy_lease_key(self._prefix, shard))
        return keys

    def close(self) -> None:
        """Close this backend's own connections."""
        self._client.close()

    # -- LeaseBackend -------------------------------------------------------

    def acquire(self, shard: int, token: str, ttl: float) -> bool:
        ms = ttl_to_ms(ttl)
        keys = self.keys(shard)
        attempts = 0

        def attempt() -> bool:
            nonlocal attempts
            attempts += 1
            if self._acquire(keys=keys, args=[token, ms]):
                return True
            if attempts > 1:
                # The first script may have run with only its reply lost;
                # then the keys (all or none) hold our (unique) token.
                return self._decode(self._client.get(keys[0])) == token
            return False

        return self._call(attempt, "lease acquire")

    def renew(self, shard: int, token: str, ttl: float) -> bool:
        ms = ttl_to_ms(ttl)
        keys = self.keys(shard)
        return self._call(lambda: bool(self._renew(keys=keys, args=[token, ms])), "lease renew")

    def release(self, shard: int, token: str) -> bool:
        keys = self.keys(shard)
        return self._call(lambda: bool(self._release(keys=keys, args=[token])), "lease release")

    def holder(self, shard: int) -> str | None:
        """The token on the hash-tagged key; with ``legacy_keys``, else the
        one on the legacy key (an old beat leading during an upgrade)."""
        keys = self.keys(shard)

        def read() -> str | None:
            for value in self._client.mget(keys):
                if value is not None:
                    return self._decode(value)
            return None

        return self._call(read, "lease holder")

    # -- helpers ------------------------------------------------------------

    @staticmethod
    def _decode(value: object) -> str | None:
        if value is None:
            return None
        if isinstance(value, bytes):
            return value.decode("utf-8")
        return str(value)

    def _call(self, fn: Callable[[], T], what: str) -> T:
        return call_quickly(fn, what=what, where=self._where)


def call_quickly(fn: Callable[[], T], *, what: str, where: str) -> T:
    """``fn()`` against Redis for the lease's side of things (the lease, the
    beats' membership): one quick retry of a dropped connection, every driver
    error translated (:func:`translate`)."""
    try:
        return call_with_retry(
            fn,
            transient=(redis.ConnectionError,),
            translate=translate,
            what=what,
            url=where,
            attempts=_ATTEMPTS,
            backoff=_RETRY_DELAY,
            max_delay=_RETRY_DELAY,
        )
    except DRIVER_ERRORS as exc:
        # Timeouts and server errors are not retried: a slow Redis would
        # only eat more of the renewal period.
        raise translate(exc) from exc
