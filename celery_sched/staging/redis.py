"""Staging on Redis: one sorted set of near-future job ids per shard.

Key ``{<prefix>:<shard>}:staging`` (:mod:`celery_sched.rediskeys`); member =
the job id as 32 hex digits; score = ``due_at`` in epoch seconds. The set is
only an accelerator in front of PostgreSQL, so failures are retried briefly and then raised as
:class:`~celery_sched.errors.StagingUnavailable`; the engine falls back to a
Postgres sweep and nothing is lost.

On a Redis Cluster each command and script here touches one key, so one
slot; a pipeline touches one shard's key only.

During a rolling upgrade from the key ``<prefix>:staging:<shard>`` (before
hash tags), old clients and old leaders still add to the legacy set and a new
leader pops only the new one. Nothing is lost, only delayed by at most the
leader's ``sweep_interval``: the set is an accelerator, never the truth. A job
an old client stages is a pending row in PostgreSQL first; the new leader's
stager re-stages pending rows of its horizon from PostgreSQL into the new
set, and its sweep claims every due pending row straight from PostgreSQL, so
a job staged only in the legacy set is claimed by whichever comes first. The
legacy set holds only ids (no payload). A leader elected once the fleet is
upgraded (``celery_sched_legacy_lease_keys`` off) retires it with
:meth:`RedisStaging.drop_legacy`: its ids are staged in the new set first, so
a job an old client staged is still popped on time, then removed from the
old one.
"""

from __future__ import annotations

import datetime as dt
import importlib.resources
import logging
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import redis.exceptions

from celery_sched.errors import CelerySchedError, StagingUnavailable
from celery_sched.interfaces import Staging
from celery_sched.redisconn import build_client, describe
from celery_sched.rediskeys import check_prefix, legacy_staging_key, shard_keys
from celery_sched.retry import call_with_retry
from celery_sched.settings import sanitize_url
from celery_sched.timeutil import ensure_utc, from_epoch_seconds, to_epoch_seconds

if TYPE_CHECKING:
    from celery_sched.redisconn import RedisClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Members per ZADD / ZREM command.
CHUNK = 10_000
#: Commands per pipeline round trip, so a huge batch is never buffered whole.
PIPELINE_CHUNKS = 10

# Connection trouble may heal within a retry; other Redis errors (OOM,
# READONLY replica, WRONGTYPE) will not, so they are translated at once.
_TRANSIENT: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
#: Every error the driver raises: redis-py's Cluster client raises some
#: (no reachable node, no node for a slot) that are not ``RedisError``.
_DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
)


def load_lua(name: str) -> str:
    """The source of the Lua script ``lua/<name>.lua`` shipped in this package."""
    return (importlib.resources.files(__package__) / "lua" / f"{name}.lua").read_text("utf-8")


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _describe(client: RedisClient) -> str:
    """A loggable URL for ``client`` (never with its password)."""
    return sanitize_url(describe(client))


class RedisStaging(Staging):
    """:class:`~celery_sched.interfaces.Staging` on Redis sorted sets.

    ``attempts`` and ``backoff`` bound the retries of connection failures; they
    stay small because the caller has a Postgres fallback and must not stall.
    Note that ``client``'s own redis-py retry policy runs inside each attempt.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str,
        attempts: int = 2,
        backoff: float = 0.05,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        check_prefix(prefix)
        self._client = client
        self._prefix = prefix
        self._attempts = attempts
        self._backoff = backoff
        self._sleep = sleep
        self._url = _describe(client)
        self._pop_due = client.register_script(load_lua("pop_due"))

    def key(self, shard: int) -> str:
        """The Redis key of ``shard``'s sorted set."""
        return shard_keys(self._prefix, shard).staging

    def drop_legacy(self, shard: int) -> int:
        """Stage the ids of ``shard``'s set of beats before hash tags in the
        current set (``ZADD NX``: an id staged there already keeps its
        score), then remove them from the old set, which Redis deletes once
        empty; return how many job ids it held. Members that are not job
        ids are removed unstaged. Two steps, not one script: on a Cluster the
        two keys are in different slots. An id an old client adds between
        the two stays for the next call; one removed after a failed copy is
        still a pending row in PostgreSQL, which the stager and the sweep find."""
        legacy = legacy_staging_key(self._prefix, shard)
        key = self.key(shard)

        def read() -> list[tuple[Any, float]]:
            rows: Any = self._client.zrange(legacy, 0, -1, withscores=True)
            return [(member, float(score)) for member, score in rows]

        found = self._call(read, f"read of {legacy}")
        if not found:
            return 0
        pairs = [(text, score) for member, score in found if (text := _job_id_text(member))]

        def zadd_nx(pipe: redis.client.Pipeline, chunk: Sequence[tuple[str, float]]) -> None:
            pipe.zadd(key, dict(chunk), nx=True)

        def zrem(pipe: redis.client.Pipeline, chunk: Sequence[Any]) -> None:
            pipe.zrem(legacy, *chunk)

        if pairs:
            self._pipelined(pairs, zadd_nx, f"restaging of {len(pairs)} ids from {legacy}")
        members = [member for member, _score in found]
        self._pipelined(members, zrem, f"removal of {len(members)} ids from {legacy}")
        return len(pairs)

    # -- Staging ------------------------------------------------------------

    def add(self, shard: int, items: Iterable[tuple[uuid.UUID, dt.datetime]]) -> int:
        pairs = [
            (job_id.hex, to_epoch_seconds(ensure_utc(due_at, name="due_at")))
            for job_id, due_at in items
        ]
        if not pairs:
            return 0
        key = self.key(shard)

        def zadd(pipe: redis.client.Pipeline, chunk: Sequence[tuple[str, float]]) -> None:
            # A dict keeps the last score of an id repeated in the batch, as
            # ZADD itself would.
            pipe.zadd(key, dict(chunk))

        # A retry after a reply was lost re-adds what the first attempt
        # stored; ZADD is idempotent, only the "new" count may come out low.
        return self._pipelined(pairs, zadd, f"staging add of {len(pairs)} ids to {key}")

    def pop_due(
        self,
        shard: int,
        now: dt.datetime,
        limit: int,
        *,
        drop_through: dt.datetime | None = None,
    ) -> list[uuid.UUID]:
        max_score, drop_score = self.pop_scores(now, limit, drop_through)
        args: list[Any] = [repr(max_score), limit]
        if drop_score is not None:
            args.append(repr(drop_score))
        if limit == 0:
            return []  # nothing to ask Redis for
        key = self.key(shard)

        def run() -> list[Any]:
            result: list[Any] = self._pop_due(keys=[key], args=args)
            return result

        # If a reply is lost after the script ran, the popped ids are gone
        # from the set but still pending in Postgres: the fallback sweep
        # claims them, so the retry only delays them.
        members = self._call(run, f"staging pop from {key}")
        return self._decode_ids(members, key)

    def next_due(self, shard: int) -> dt.datetime | None:
        key = self.key(shard)

        def run() -> list[Any]:
            return list(self._client.zrange(key, 0, 0, withscores=True))

        first = self._call(run, f"staging next_due of {key}")
        if not first:
            return None
        return from_epoch_seconds(float(first[0][1]))

    def remove(self, shard: int, ids: Iterable[uuid.UUID]) -> int:
        members = [job_id.hex for job_id in ids]
        if not members:
            return 0
        key = self.key(shard)

        def zrem(pipe: redis.client.Pipeline, chunk: Sequence[str]) -> None:
            pipe.zrem(key, *chunk)

        return self._pipelined(members, zrem, f"staging remove of {len(members)} ids from {key}")

    def size(self, shard: int) -> int:
        key = self.key(shard)

        def run() -> int:
            return int(self._client.zcard(key))

        return self._call(run, f"staging size of {key}")

    # -- internals ----------------------------------------------------------

    def _pipelined(
        self,
        items: Sequence[T],
        command: Callable[[redis.client.Pipeline, Sequence[T]], None],
        what: str,
    ) -> int:
        """Queue ``command`` per :data:`CHUNK` of ``items``, :data:`PIPELINE_CHUNKS`
        commands per round trip; return the sum of the replies."""
        total = 0
        step = CHUNK * PIPELINE_CHUNKS
        for start in range(0, len(items), step):
            part = items[start : start + step]

            def run(part: Sequence[T] = part) -> int:
                pipe = self._client.pipeline(transaction=False)
                for chunk in _chunks(part, CHUNK):
                    command(pipe, chunk)
                return sum(int(n) for n in pipe.execute())

            total += self._call(run, what)
        return total

    def _call(self, fn: Callable[[], T], what: str) -> T:
        def translate(exc: BaseException) -> CelerySchedError:
            return StagingUnavailable(
                f"the staging area (Redis at {self._url}) failed during {what}: "
                f"{type(exc).__name__}: {exc}"
            )

        extra: dict[str, Any] = {} if self._sleep is None else {"sleep": self._sleep}
        try:
            return call_with_retry(
                fn,
                transient=_TRANSIENT,
                translate=translate,
                what=what,
                url=self._url,
                attempts=self._attempts,
                backoff=self._backoff,
                max_delay=max(self._backoff, 1.0),
                **extra,
            )
        except _DRIVER_ERRORS as exc:
            # Not transient, yet still a driver error: nothing above this
            # module may see one.
            raise translate(exc) from exc

    @staticmethod
    def _decode_ids(members: Iterable[Any], key: str) -> list[uuid.UUID]:
        ids: list[uuid.UUID] = []
        for member in members:
            try:
                text = member.decode("ascii") if isinstance(member, bytes) else str(member)
                ids.append(uuid.UUID(hex=text))
            except ValueError:
                # Someone else wrote into our key; dropping the stray member
                # is harmless because Postgres, not this set, is the truth.
                logger.warning("ignoring a staged member that is not a job id in %s", key)
        return ids


def _job_id_text(member: Any) -> str | None:
    """``member`` as the 32 hex digits of a job id, or None if it is not one."""
    try:
        text = member.decode("ascii") if isinstance(member, bytes) else str(member)
        return uuid.UUID(hex=text).hex if len(text) == 32 else None
    except ValueError:
        return None


def probe(url: str, *, timeout: float) -> None:
    """PING the Redis at ``url`` once, on a connection of its own; raise
    :class:`StagingUnavailable` if it does not answer within ``timeout`` seconds.

    For the readiness probe: no retries, and nothing shared with the leader.
    A Cluster client reads its slot map at the PING, and raises redis-py's
    own Cluster errors when no seed answers; they are caught too.
    """
    try:
        client = build_client(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()
    except _DRIVER_ERRORS as exc:
        raise StagingUnavailable(
            f"Redis at {sanitize_url(url)} is unavailable: {type(exc).__name__}: {exc}"
        ) from exc
