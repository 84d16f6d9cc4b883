"""Redis URLs and the clients built from them: a plain Redis, a primary
found through Redis Sentinel, or a Redis Cluster.

Plain URLs (``redis://``, ``rediss://``, ``unix://``) go to redis-py's
``Redis.from_url`` unchanged. Two Sentinel forms are read:

* ``redis+sentinel://[[user]:password@]host1:26379,host2,host3/<service>[/<db>]``
  ``[?sentinel_password=...&ssl=true]`` (the preferred one: one URL, the
  service in its path);
* Celery/Kombu's broker form, ``sentinel://[[user]:password@]host1:26379[/<db>];``
  ``sentinel://host2:26379?master_name=<service>`` (each sentinel a URL of its
  own, joined by ``;``; the service in ``master_name``), so a project can
  reuse the string it gives ``broker_url``.

A host without a port is at 26379. The user part is the data nodes'
credentials (the primary's ``AUTH``); ``sentinel_password`` is the
sentinels' own, if they require one; ``ssl`` turns on TLS to both.

A Cluster URL names seed nodes (any few of the cluster's masters):

* ``redis+cluster://[[user]:password@]host1:7000,host2:7001,...[/][?ssl=true]``

(a host without a port is at 6379; a Cluster has no databases, so the path
is empty, ``/`` or ``/0``). It gives a redis-py ``RedisCluster(startup_nodes=...)``,
which learns the slot map from the seeds and routes each command by its
key's slot; a script or a transaction must then touch keys of one slot only,
which the shard's hash tag (:mod:`celery_sched.rediskeys`) guarantees.
redis-py's ``RedisCluster`` reads the slot map while it is built, and raises
when no seed answers; the one built here waits for its first use, like the
other clients, so a beat whose Cluster is down comes up and keeps retrying
(each use raises redis-py's error until a seed answers). Its retries are
bounded (:data:`CLUSTER_RETRIES`, short backoffs): redis-py's default
retries a command on a dead master for seconds, which would stall the
leader's loop for a whole failover.

A Sentinel URL gives a client of ``Sentinel(...).master_for(service)``: each
new connection asks the sentinels where the primary is, and a connection to
a server that was demoted (``READONLY``) or is gone is dropped, so after a
failover the next command reaches the promoted replica. Callers see the same
``redis.ConnectionError`` as for a plain Redis in the meantime.

Only this module builds Redis clients from URLs, so every part of
celery_sched (lease, staging, leader board, readiness probe) reads both
forms the same way. Parsing needs nothing but the standard library, so
:mod:`celery_sched.settings` checks URLs with it without importing redis.
"""

from __future__ import annotations

import dataclasses
import functools
import urllib.parse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from celery_sched.errors import InvalidURL
from celery_sched.urls import sanitize_url

if TYPE_CHECKING:
    from typing import TypeAlias

    import redis
    from redis.cluster import RedisCluster
    from redis.retry import Retry

    #: What :func:`build_client` gives: a plain or Sentinel client, or a
    #: Cluster client (not a subclass of ``redis.Redis`` in redis-py).
    RedisClient: TypeAlias = redis.Redis | RedisCluster

__all__ = [
    "CLUSTER_RETRIES",
    "DEFAULT_CLUSTER_PORT",
    "DEFAULT_SENTINEL_PORT",
    "ClusterTarget",
    "RedisClient",
    "SentinelTarget",
    "build_client",
    "check_url",
    "clone_client",
    "cluster_target",
    "describe",
    "is_cluster_client",
    "is_cluster_url",
    "is_connected",
    "is_sentinel_url",
    "sentinel_target",
]

DEFAULT_SENTINEL_PORT = 26379
DEFAULT_CLUSTER_PORT = 6379

#: Retries of a command by a Cluster client built without a ``retry``, and
#: the bounds (seconds) of their jittered exponential backoff. Enough for a
#: retry on the refreshed slot map after a failover was completed; during a
#: failover a command fails in well under a second instead of redis-py's
#: default of retrying for seconds.
CLUSTER_RETRIES = 2
CLUSTER_BACKOFF_BASE = 0.05
CLUSTER_BACKOFF_CAP = 0.25

#: The schemes of a plain Redis URL (what redis-py's ``from_url`` reads).
PLAIN_SCHEMES = ("redis", "rediss", "unix")
#: The preferred Sentinel scheme, and Kombu's.
SENTINEL_SCHEME = "redis+sentinel"
KOMBU_SENTINEL_SCHEME = "sentinel"
#: The Cluster scheme.
CLUSTER_SCHEME = "redis+cluster"

#: Query parameters a Sentinel URL may carry (anything else is refused: a
#: misspelt ``sentinel_pasword`` must not be silently ignored).
_SENTINEL_PARAMETERS = frozenset({"sentinel_password", "ssl", "master_name"})
_CLUSTER_PARAMETERS = frozenset({"ssl"})

#: Builds the error of one URL from what is wrong with it.
_Invalid = Callable[[str], InvalidURL]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

#: Connection kwargs a redis-py pool fills in for itself (handlers bound to
#: that pool; the proxy of a Sentinel pool), or that would turn its retries
#: back on; a pool cloned by :func:`clone_client` makes its own.
_POOL_OWNED = frozenset(
    {
        "connection_pool",
        "maint_notifications_pool_handler",
        "oss_cluster_maint_notifications_handler",
        "himport_registry",
        "retry",
        "retry_on_timeout",
        "retry_on_error",
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SentinelTarget:
    """What a Sentinel URL names: where the sentinels are, which service's
    primary to use, and how to talk to it."""

    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    sentinel_password: str | None = dataclasses.field(default=None, repr=False)
    ssl: bool = False

    def __post_init__(self) -> None:
        if not self.sentinels:
            raise ValueError("a Sentinel target needs at least one sentinel")
        if not self.service_name:
            raise ValueError("a Sentinel target needs a service name")

    def describe(self) -> str:
        """The target as a ``redis+sentinel://`` URL without credentials."""
        hosts = ",".join(f"{_host_text(host)}:{port}" for host, port in self.sentinels)
        return f"{SENTINEL_SCHEME}://{hosts}/{self.service_name}/{self.db}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterTarget:
    """What a Cluster URL names: seed nodes and how to talk to the cluster."""

    nodes: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    ssl: bool = False

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("a Cluster target needs at least one seed node")

    def describe(self) -> str:
        """The target as a ``redis+cluster://`` URL without credentials."""
        hosts = ",".join(f"{_host_text(host)}:{port}" for host, port in self.nodes)
        return f"{CLUSTER_SCHEME}://{hosts}/"


# -- parsing ----------------------------------------------------------------------------


def _scheme(url: str) -> str:
    return url.partition("://")[0].lower() if "://" in url else ""


def is_sentinel_url(url: str) -> bool:
    """Whether ``url`` is in one of the Sentinel forms (valid or not)."""
    return _scheme(url) in (SENTINEL_SCHEME, KOMBU_SENTINEL_SCHEME)


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` is a Redis Cluster URL (valid or not)."""
    return _scheme(url) == CLUSTER_SCHEME


def check_url(url: str, *, name: str = "celery_sched_redis_url") -> None:
    """Raise :class:`~celery_sched.errors.InvalidURL` (naming setting or
    option ``name``, the password masked) unless ``url`` is a Redis URL of
    one of the accepted forms."""
    if is_sentinel_url(url):
        sentinel_target(url, name=name)
        return
    if is_cluster_url(url):
        cluster_target(url, name=name)
        return
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise InvalidURL(f"{name} is not a Redis URL: {sanitize_url(url)}") from exc
    if parts.scheme not in PLAIN_SCHEMES or (parts.scheme != "unix" and not parts.hostname):
        raise InvalidURL(
            f"{name} is not a Redis URL (redis://, rediss://, unix://, {SENTINEL_SCHEME}://, "
            f"{KOMBU_SENTINEL_SCHEME}:// or {CLUSTER_SCHEME}://): {sanitize_url(url)}"
        )
    try:
        parts.port  # noqa: B018  (raises on a malformed port)
    except ValueError as exc:
        raise InvalidURL(f"{name} has a bad port: {sanitize_url(url)}") from exc


def sentinel_target(url: str, *, name: str = "celery_sched_redis_url") -> SentinelTarget:
    """The :class:`SentinelTarget` of a Sentinel URL (either form).

    Raises :class:`~celery_sched.errors.InvalidURL` naming what is wrong (no
    sentinel, no service name, a bad port or db, an unknown parameter), with
    the URL's passwords masked.
    """

    def invalid(problem: str) -> InvalidURL:
        return InvalidURL(f"{name} {problem}: {sanitize_url(url)}")

    scheme = _scheme(url)
    if scheme == SENTINEL_SCHEME:
        return _parse_preferred(url, invalid)
    if scheme == KOMBU_SENTINEL_SCHEME:
        return _parse_kombu(url, invalid)
    raise invalid(f"is not a Sentinel URL ({SENTINEL_SCHEME}:// or {KOMBU_SENTINEL_SCHEME}://)")


def cluster_target(url: str, *, name: str = "celery_sched_redis_url") -> ClusterTarget:
    """The :class:`ClusterTarget` of a ``redis+cluster://`` URL.

    Raises :class:`~celery_sched.errors.InvalidURL` naming what is wrong (no
    seed node, an empty host, a bad port, a database other than 0, an
    unknown parameter), with the URL's password masked.
    """

    def invalid(problem: str) -> InvalidURL:
        return InvalidURL(f"{name} {problem}: {sanitize_url(url)}")

    if not is_cluster_url(url):
        raise invalid(f"is not a Cluster URL ({CLUSTER_SCHEME}://)")
    parts = _split(url, invalid)
    hosts = parts.netloc.rpartition("@")[2]
    if not hosts:
        raise invalid(f"names no seed node ({CLUSTER_SCHEME}://host1:7000,host2:7001/)")
    if parts.path not in ("", "/", "/0"):
        raise invalid("has a path; a Redis Cluster has no databases (leave it empty or /0)")
    query = _query(parts.query, invalid, known=_CLUSTER_PARAMETERS)
    username, password = _credentials(parts, invalid)
    return ClusterTarget(
        nodes=_hosts(hosts.split(","), invalid, role="seed node", default=DEFAULT_CLUSTER_PORT),
        username=username,
        password=password,
        ssl=_flag(query["ssl"], invalid) if "ssl" in query else False,
    )


def _parse_preferred(url: str, invalid: _Invalid) -> SentinelTarget:
    parts = _split(url, invalid)
    hosts = parts.netloc.rpartition("@")[2]
    segments = [urllib.parse.unquote(s) for s in parts.path.split("/")[1:]]
    if segments and segments[-1] == "":
        segments.pop()  # a trailing slash
    if not segments or not segments[0]:
        raise invalid("names no Sentinel service (redis+sentinel://hosts/<service>[/<db>])")
    if len(segments) > 2:
        raise invalid("has more than /<service>/<db> in its path")
    query = _query(parts.query, invalid)
    if "master_name" in query:
        raise invalid("names its service in the path; master_name is for sentinel:// URLs")
    username, password = _credentials(parts, invalid)
    return _target(
        sentinels=_sentinels(hosts.split(","), invalid),
        service_name=segments[0],
        db=_db(segments[1] if len(segments) == 2 else "", invalid),
        username=username,
        password=password,
        query=query,
        invalid=invalid,
    )


def _parse_kombu(url: str, invalid: _Invalid) -> SentinelTarget:
    hosts: list[str] = []
    dbs: set[int] = set()
    credentials: set[tuple[str | None, str | None]] = set()
    query: dict[str, str] = {}
    for piece in url.split(";"):
        if _scheme(piece) != KOMBU_SENTINEL_SCHEME:
            raise invalid("mixes sentinel:// with other URLs in one ;-separated list")
        parts = _split(piece, invalid)
        hosts.append(parts.netloc.rpartition("@")[2])
        if parts.path not in ("", "/"):
            dbs.add(_db(parts.path.strip("/"), invalid))
        if "@" in parts.netloc:
            credentials.add(_credentials(parts, invalid))
        for key, value in _query(parts.query, invalid).items():
            if query.setdefault(key, value) != value:
                raise invalid(f"gives {key} two different values")
    if len(dbs) > 1 or len(credentials) > 1:
        raise invalid("gives its sentinels different databases or credentials")
    service = query.pop("master_name", "")
    if not service:
        raise invalid("names no Sentinel service (add ?master_name=<service>)")
    username, password = credentials.pop() if credentials else (None, None)
    return _target(
        sentinels=_sentinels(hosts, invalid),
        service_name=service,
        db=dbs.pop() if dbs else 0,
        username=username,
        password=password,
        query=query,
        invalid=invalid,
    )


def _split(url: str, invalid: _Invalid) -> urllib.parse.SplitResult:
    try:
        return urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise invalid(f"cannot be parsed ({exc})") from None


def _credentials(
    parts: urllib.parse.SplitResult, invalid: _Invalid
) -> tuple[str | None, str | None]:
    try:
        username, password = parts.username, parts.password
    except ValueError:
        raise invalid("has a malformed user part") from None
    user = urllib.parse.unquote(username) if username else None
    return user, None if password is None else urllib.parse.unquote(password)


def _query(
    query: str, invalid: _Invalid, *, known: frozenset[str] = _SENTINEL_PARAMETERS
) -> dict[str, str]:
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    values: dict[str, str] = {}
    for key, value in pairs:
        if key not in known:
            names = ", ".join(sorted(known))
            raise invalid(f"has an unknown parameter {key!r} (known: {names})")
        if key in values:
            raise invalid(f"gives {key} twice")
        values[key] = value
    return values


def _sentinels(hosts: list[str], invalid: _Invalid) -> tuple[tuple[str, int], ...]:
    return _hosts(hosts, invalid, role="sentinel", default=DEFAULT_SENTINEL_PORT)


def _hosts(
    hosts: list[str], invalid: _Invalid, *, role: str, default: int
) -> tuple[tuple[str, int], ...]:
    found: list[tuple[str, int]] = []
    for text in hosts:
        if not text:
            raise invalid(f"names an empty {role} host")
        # urlsplit reads one host at a time, brackets of IPv6 literals included.
        probe = urllib.parse.urlsplit(f"//{text}")
        try:
            host, port = probe.hostname, probe.port
        except ValueError:
            raise invalid(f"has a bad port in {role} {text!r}") from None
        if not host:
            raise invalid(f"has a {role} with no host ({text!r})")
        found.append((host, default if port is None else port))
    if not found:
        raise invalid(f"names no {role}")
    return tuple(found)


def _db(text: str, invalid: _Invalid) -> int:
    if text == "":
        return 0
    if not text.isdigit():
        raise invalid(f"has a bad database number {text!r} (a whole number >= 0)")
    return int(text)


def _flag(text: str, invalid: _Invalid) -> bool:
    lowered = text.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise invalid(f"has ssl={text!r} (true or false)")


def _target(
    *,
    sentinels: tuple[tuple[str, int], ...],
    service_name: str,
    db: int,
    username: str | None,
    password: str | None,
    query: Mapping[str, str],
    invalid: _Invalid,
) -> SentinelTarget:
    return SentinelTarget(
        sentinels=sentinels,
        service_name=service_name,
        db=db,
        username=username,
        password=password,
        sentinel_password=query.get("sentinel_password") or None,
        ssl=_flag(query["ssl"], invalid) if "ssl" in query else False,
    )


def _host_text(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# -- clients ----------------------------------------------------------------------------


def build_client(
    url: str, *, name: str = "celery_sched_redis_url", **connection_kwargs: Any
) -> RedisClient:
    """A client of the Redis ``url`` names.

    ``connection_kwargs`` (timeouts, ``health_check_interval``,
    ``decode_responses``, ...) apply to the data connections; a Sentinel
    client's queries to the sentinels use the same socket timeouts. A plain
    URL goes to ``Redis.from_url`` unchanged; a malformed Sentinel or Cluster
    URL raises :class:`~celery_sched.errors.InvalidURL` naming setting or
    option ``name``, and nothing is built. Every client is lazy: it connects
    on first use (a Cluster client reads the slot map from its seeds then).
    Closing a Sentinel client closes its connections to the sentinels too.
    """
    import redis as redis_lib

    if is_cluster_url(url):
        return _cluster_client(cluster_target(url, name=name), connection_kwargs)
    if not is_sentinel_url(url):
        return redis_lib.Redis.from_url(url, **connection_kwargs)
    target = sentinel_target(url, name=name)
    return _master_client(
        sentinels=target.sentinels,
        sentinel_kwargs=_sentinel_kwargs(target, connection_kwargs),
        service_name=target.service_name,
        connection_kwargs={
            "db": target.db,
            "username": target.username,
            "password": target.password,
            "ssl": target.ssl,
            **connection_kwargs,
        },
    )


def is_cluster_client(client: RedisClient) -> bool:
    """Whether ``client`` is a Redis Cluster client (keys of one script or
    transaction must then share a slot)."""
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def clone_client(client: RedisClient, *, max_connections: int, **overrides: Any) -> RedisClient:
    """A client with a pool of its own, talking to what ``client`` talks to
    with ``client``'s connection settings, except ``overrides``.

    The new pool starts without ``client``'s retry policy (pass ``retry``).
    A Sentinel client's clone asks the same sentinels for the same service,
    over connections of its own whose socket timeouts follow ``overrides``,
    so a slow sentinel cannot hold it longer than its data connections. A
    Cluster client's clone starts from the same seed nodes, with
    ``max_connections`` per node and ``retry`` as its cluster-level policy
    (redis-py retries node errors there, not per connection).
    """
    import redis as redis_lib
    from redis.cluster import RedisCluster
    from redis.sentinel import SentinelConnectionPool

    if isinstance(client, RedisCluster):
        return _clone_cluster(client, max_connections=max_connections, overrides=overrides)
    pool = client.connection_pool
    # The pool adds bookkeeping of its own to these kwargs (handlers bound to
    # that pool, saved original timeouts); the new pool must make its own.
    kwargs: dict[str, Any] = {
        name: value
        for name, value in pool.connection_kwargs.items()
        if name not in _POOL_OWNED and not name.startswith("orig_")
    }
    kwargs.update(overrides)
    if not isinstance(pool, SentinelConnectionPool):
        own = redis_lib.ConnectionPool(
            connection_class=pool.connection_class, max_connections=max_connections, **kwargs
        )
        return redis_lib.Redis(connection_pool=own)
    manager = pool.sentinel_manager
    sentinel_kwargs = dict(manager.sentinel_kwargs)
    sentinel_kwargs.update({k: v for k, v in overrides.items() if k.startswith("socket_")})
    return _master_client(
        sentinels=tuple(_address(sentinel) for sentinel in manager.sentinels),
        sentinel_kwargs=sentinel_kwargs,
        service_name=pool.service_name,
        connection_kwargs={
            "connection_class": pool.connection_class,
            "max_connections": max_connections,
            **kwargs,
        },
    )


def describe(client: RedisClient) -> str:
    """A loggable URL of what ``client`` talks to (never with a password)."""
    from redis.cluster import RedisCluster
    from redis.sentinel import SentinelConnectionPool

    if isinstance(client, RedisCluster):
        return ClusterTarget(nodes=_seeds(client)).describe()
    pool = client.connection_pool
    kwargs: Mapping[str, Any] = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        return SentinelTarget(
            sentinels=tuple(_address(sentinel) for sentinel in pool.sentinel_manager.sentinels),
            service_name=pool.service_name,
            db=int(kwargs.get("db") or 0),
        ).describe()
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    return (
        f"redis://{_host_text(str(kwargs.get('host', 'localhost')))}:{kwargs.get('port', 6379)}"
        f"/{kwargs.get('db', 0)}"
    )


def _cluster_client(target: ClusterTarget, connection_kwargs: Mapping[str, Any]) -> RedisCluster:
    from redis.cluster import ClusterNode

    kwargs: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.ssl:
        kwargs["ssl"] = True
    kwargs.update(connection_kwargs)
    # health_check_interval is a per-connection option redis-py's cluster
    # passes on; retry is the cluster's own and must not reach the nodes.
    retry = kwargs.pop("retry", None)
    return _lazy_cluster_class()(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],  # type: ignore[no-untyped-call]
        retry=retry if retry is not None else _cluster_retry(),
        connection_kwargs=kwargs,
    )


def _cluster_retry() -> Retry:
    from redis.backoff import ExponentialWithJitterBackoff
    from redis.retry import Retry

    return Retry(
        ExponentialWithJitterBackoff(base=CLUSTER_BACKOFF_BASE, cap=CLUSTER_BACKOFF_CAP),
        CLUSTER_RETRIES,
    )


def is_connected(client: RedisClient) -> bool:
    """Whether a Cluster ``client`` has read its slot map (always True for
    the other clients, whose pools connect per command)."""
    return getattr(client, "_lazy_ready", True) is not False


@functools.cache
def _lazy_cluster_class() -> type[RedisCluster]:
    import threading

    from redis._parsers.encoders import Encoder
    from redis.cluster import RedisCluster

    class LazyRedisCluster(RedisCluster):
        """A ``RedisCluster`` that reads the slot map on first use.

        ``RedisCluster.__init__`` connects to the seeds; here it runs when a
        command (or anything else) first needs an attribute it sets, under a
        lock, and again on the next use if it failed. Until then the client
        answers only what needs no server: its seeds, encoder, retry policy
        and connection kwargs (so it can be described and cloned), and
        ``close()``.
        """

        def __init__(
            self,
            *,
            startup_nodes: list[Any],
            retry: Retry,
            connection_kwargs: dict[str, Any],
        ) -> None:
            # No super().__init__(): that is the part that connects.
            self._lazy_lock = threading.RLock()
            self._lazy_ready = False
            self._lazy_building = False
            self._lazy_args: dict[str, Any] = {
                "startup_nodes": list(startup_nodes),
                "retry": retry,
                **connection_kwargs,
            }
            self._lazy_connection_kwargs = dict(connection_kwargs)
            self.startup_nodes = list(startup_nodes)
            self.retry = retry
            self.encoder = Encoder(  # type: ignore[no-untyped-call]
                connection_kwargs.get("encoding", "utf-8"),
                connection_kwargs.get("encoding_errors", "strict"),
                connection_kwargs.get("decode_responses", False),
            )

        def __getattr__(self, name: str) -> Any:
            # Called only for attributes not set yet: those RedisCluster's
            # __init__ sets, i.e. a first use.
            if name.startswith("_lazy") or name.startswith("__"):
                raise AttributeError(name)
            self._lazy_connect()
            return object.__getattribute__(self, name)

        def _lazy_connect(self) -> None:
            with self._lazy_lock:
                if self._lazy_ready or self._lazy_building:
                    # (Building: RedisCluster.__init__ itself asked for an
                    # attribute it has not set yet; it is missing.)
                    return
                self._lazy_building = True
                try:
                    # Raises redis-py's error (no seed answers) to this use;
                    # the next use tries again.
                    RedisCluster.__init__(self, **self._lazy_args)
                    self._lazy_ready = True
                finally:
                    self._lazy_building = False

        def get_connection_kwargs(self) -> dict[str, Any]:
            if not self._lazy_ready:
                return dict(self._lazy_connection_kwargs)
            kwargs: dict[str, Any] = super().get_connection_kwargs()  # type: ignore[no-untyped-call]
            return kwargs

        def close(self) -> None:
            if self._lazy_ready:
                super().close()

    return LazyRedisCluster


#: Connection kwargs a ``RedisCluster`` fills in for its node clients (its
#: own bound hooks); a clone makes its own.
_CLUSTER_OWNED = frozenset({"redis_connect_func", "host", "port"})


def _clone_cluster(
    client: RedisCluster, *, max_connections: int, overrides: Mapping[str, Any]
) -> RedisCluster:
    kwargs: dict[str, Any] = {
        name: value
        for name, value in client.get_connection_kwargs().items()  # type: ignore[no-untyped-call]
        if name not in _POOL_OWNED and name not in _CLUSTER_OWNED and not name.startswith("orig_")
    }
    kwargs.update(overrides)
    kwargs["max_connections"] = max_connections
    target = ClusterTarget(nodes=_seeds(client))
    return _cluster_client(target, kwargs)


def _seeds(client: RedisCluster) -> tuple[tuple[str, int], ...]:
    """The seed nodes ``client`` was built with (what its URL named)."""
    return tuple((str(node.host), int(node.port)) for node in client.startup_nodes)


def _address(sentinel: redis.Redis) -> tuple[str, int]:
    kwargs = sentinel.connection_pool.connection_kwargs
    return str(kwargs["host"]), int(kwargs["port"])


def _sentinel_kwargs(
    target: SentinelTarget, connection_kwargs: Mapping[str, Any]
) -> dict[str, Any]:
    # redis-py copies only the socket_* options to the sentinels when given
    # no sentinel_kwargs; the sentinels' own password and TLS go here too.
    kwargs = {k: v for k, v in connection_kwargs.items() if k.startswith("socket_")}
    if target.sentinel_password is not None:
        kwargs["password"] = target.sentinel_password
    if target.ssl:
        kwargs["ssl"] = True
    return kwargs


def _master_client(
    *,
    sentinels: tuple[tuple[str, int], ...],
    sentinel_kwargs: Mapping[str, Any],
    service_name: str,
    connection_kwargs: Mapping[str, Any],
) -> redis.Redis:
    from redis.sentinel import Sentinel

    manager = Sentinel(list(sentinels), sentinel_kwargs=dict(sentinel_kwargs))
    client: redis.Redis = manager.master_for(
        service_name, redis_class=_sentinel_client_class(), **connection_kwargs
    )
    return client


@functools.cache
def _sentinel_client_class() -> type[redis.Redis]:
    import redis as redis_lib

    class SentinelRedis(redis_lib.Redis):
        """A primary's client that owns its Sentinel manager: closing it
        closes the connections to the sentinels as well (redis-py leaves
        them open, and the readiness probe builds a client per check)."""

        def close(self) -> None:
            from redis.sentinel import SentinelConnectionPool

            try:
                super().close()
            finally:
                pool = self.connection_pool
                if isinstance(pool, SentinelConnectionPool):
                    pool.sentinel_manager.close()

    return SentinelRedis
