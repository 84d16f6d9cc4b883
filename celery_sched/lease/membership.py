"""Who is alive among the beats that share the shards: a Redis sorted set.

Every beat without a pinned shard lists itself in ``{<prefix>}:beats``
(:func:`celery_sched.rediskeys.beats_key`) every ``ttl / 3`` seconds, scored
by the instant its listing runs out, and reads the whole set back in the
same script (``lua/beats.lua``). Redis's clock decides expiry, as for the
lease: a beat whose clock is off cannot keep a dead peer listed. A beat that
stops cleanly removes itself at once, so its shards move without waiting.

Nothing here decides who leads: the set only tells each beat how many peers
share the shards (:mod:`celery_sched.leader.balancing`). The lease and the
PostgreSQL epoch still guarantee one leader per shard whatever the set says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from redis.commands.core import Script

from celery_sched.interfaces import Membership
from celery_sched.lease.redis import call_quickly, load_script, ttl_to_ms
from celery_sched.redisconn import describe
from celery_sched.rediskeys import beats_key

if TYPE_CHECKING:
    from celery_sched.redisconn import RedisClient

T = TypeVar("T")

__all__ = ["RedisMembership"]


class RedisMembership(Membership):
    """:class:`~celery_sched.interfaces.Membership` on one Redis sorted set."""

    def __init__(self, client: RedisClient, *, prefix: str) -> None:
        self._key = beats_key(prefix)
        self._client = client
        self._where = describe(client)
        self._script: Script = client.register_script(load_script("beats"))

    @property
    def key(self) -> str:
        return self._key

    def heartbeat(self, beat: str, ttl: float) -> list[str]:
        if not beat:
            raise ValueError("a beat id must not be empty")
        ms = ttl_to_ms(ttl)
        members = self._call(
            lambda: self._script(keys=[self._key], args=[beat, ms]), "beats heartbeat"
        )
        return sorted(_text(member) for member in members)

    def leave(self, beat: str) -> None:
        self._call(lambda: self._client.zrem(self._key, beat), "beats leave")

    def _call(self, fn: Callable[[], T], what: str) -> T:
        return call_quickly(fn, what=what, where=self._where)


def _text(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)
