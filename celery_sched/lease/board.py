"""The leader board on Redis: who leads each shard, for operators.

Per shard, beside the lease key ``{<prefix>:<n>}:lease`` (whose value is the
holder's token, ``host:pid:<random>``, and whose PTTL is the lease's time
left), the leader writes ``{<prefix>:<n>}:leader`` (:mod:`celery_sched.rediskeys`;
before hash tags it was ``<prefix>:leader:<n>``, which is simply no longer
written): a small JSON report of its
host, pid, epoch and the end of its last pass by the store's clock. One
``SET ... EX`` per post, and the leader posts at most about once a second
(:mod:`celery_sched.leader.presence`); a report outlives its leader by a day,
so a dead leader's last pass stays visible. :meth:`RedisLeaderBoard.read`
reads every shard's values in one pipelined round trip; it reads the legacy
lease key ``<prefix>:lease:<n>`` too, so an old beat leading a shard during a
rolling upgrade is shown. On a Redis Cluster the pipeline is redis-py's
non-transactional ``ClusterPipeline``, which sends each node its commands:
single-key reads, so keys of different slots are fine there.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from celery_sched.interfaces import LeaderBoard
from celery_sched.lease.elector import token_holder
from celery_sched.lease.redis import DRIVER_ERRORS, translate
from celery_sched.models import LeaderReport, LeaderView
from celery_sched.rediskeys import check_prefix, legacy_lease_key, shard_keys

if TYPE_CHECKING:
    from celery_sched.redisconn import RedisClient

T = TypeVar("T")

#: Seconds a leader's report is kept after its last post.
REPORT_TTL = 86400


def report_key(prefix: str, shard: int) -> str:
    """The Redis key of shard ``shard``'s last leader report."""
    return shard_keys(prefix, shard).leader


def encode_report(report: LeaderReport) -> str:
    return json.dumps(
        {
            "host": report.host,
            "pid": report.pid,
            "epoch": report.epoch,
            "pass_at": report.pass_at.isoformat(),
        },
        sort_keys=True,
    )


def decode_report(shard: int, raw: str | bytes | None) -> LeaderReport | None:
    """The report stored for ``shard``; ``None`` if absent or unreadable
    (a report is informative only: a bad one must not break the reader)."""
    if raw is None:
        return None
    try:
        data: Any = json.loads(raw)
        return LeaderReport(
            shard=shard,
            host=str(data["host"]),
            pid=int(data["pid"]),
            epoch=int(data["epoch"]),
            pass_at=dt.datetime.fromisoformat(data["pass_at"]),
        )
    except (ValueError, TypeError, KeyError):
        return None


class RedisLeaderBoard(LeaderBoard):
    """:class:`~celery_sched.interfaces.LeaderBoard` on Redis keys under ``prefix``."""

    def __init__(self, client: RedisClient, *, prefix: str) -> None:
        check_prefix(prefix)
        self._client = client
        self._prefix = prefix

    def post(self, report: LeaderReport) -> None:
        key = report_key(self._prefix, report.shard)
        self._call(lambda: self._client.set(key, encode_report(report), ex=REPORT_TTL))

    def read(self, shards: Sequence[int]) -> list[LeaderView]:
        def fetch() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for shard in shards:
                keys = shard_keys(self._prefix, shard)
                legacy = legacy_lease_key(self._prefix, shard)
                pipe.get(keys.lease)
                pipe.pttl(keys.lease)
                pipe.get(legacy)
                pipe.pttl(legacy)
                pipe.get(keys.leader)
            return list(pipe.execute())

        replies = self._call(fetch)
        views = []
        for index, shard in enumerate(shards):
            token, pttl, old_token, old_pttl, raw = replies[5 * index : 5 * index + 5]
            if token is None:
                # No new beat leads; an old one (before hash tags) may.
                token, pttl = old_token, old_pttl
            holder = None if token is None else token_holder(_text(token))
            views.append(
                LeaderView(
                    shard=shard,
                    holder=holder,
                    # PTTL: -2 no key, -1 no expiry (never for a lease).
                    ttl=pttl / 1000 if holder is not None and pttl >= 0 else None,
                    report=decode_report(shard, raw),
                )
            )
        return views

    @staticmethod
    def _call(fn: Callable[[], T]) -> T:
        try:
            return fn()
        except DRIVER_ERRORS as exc:
            raise translate(exc) from exc


def _text(value: str | bytes) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value
