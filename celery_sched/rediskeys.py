"""The name of every Redis key a shard uses: the only place they are formatted.

A shard's keys share one hash tag, the whole per-shard identity
``{<prefix>:<shard>}``:

* ``{celery_sched:3}:lease``   the leader lease (its value is the holder's token);
* ``{celery_sched:3}:staging`` the sorted set of near-future job ids;
* ``{celery_sched:3}:leader``  the leader's last report (the leader board).

Why this form: Redis Cluster hashes only the text between the first ``{``
and the next ``}``, and a Lua script or a transaction may touch keys of one
slot only. With the prefix *and* the shard inside the tag, all of a shard's
keys share a slot (a script over them is legal), while different shards,
and the same shard under different prefixes (two deployments, or two tests,
on one Cluster), hash apart and spread over the masters. A tag of the shard
alone (``celery_sched:{3}:lease``) would put shard 3 of every deployment in
one slot. So the key starts with ``{``; :func:`key_patterns` gives the
SCAN patterns of everything under a prefix.

Beats before hash tags named the lease ``<prefix>:lease:<shard>``
(:func:`legacy_lease_key`), the staging set ``<prefix>:staging:<shard>`` and
the report ``<prefix>:leader:<shard>``. During a rolling upgrade a new beat
holds the old lease key as well as the new one (``celery_sched_legacy_lease_keys``,
:mod:`celery_sched.lease.redis`), and :func:`legacy_staging_key` names the
set the old clients still fill.

Stdlib only: :mod:`celery_sched.settings` checks prefixes with it.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "ShardKeys",
    "beats_key",
    "check_prefix",
    "key_patterns",
    "legacy_lease_key",
    "legacy_staging_key",
    "shard_keys",
]

#: Characters a prefix may not hold: either would move or end the hash tag.
_TAG_BRACES = frozenset("{}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardKeys:
    """The keys of one shard, all in one Cluster slot."""

    lease: str
    staging: str
    leader: str


def check_prefix(prefix: str) -> None:
    """Raise :class:`ValueError` unless ``prefix`` can go inside a hash tag."""
    if not prefix:
        raise ValueError("the Redis key prefix must not be empty")
    if _TAG_BRACES & set(prefix):
        raise ValueError(
            f"the Redis key prefix {prefix!r} holds a brace; '{{' and '}}' would "
            "break the per-shard hash tag"
        )


def shard_keys(prefix: str, shard: int) -> ShardKeys:
    """Every key of shard ``shard`` under ``prefix``."""
    check_prefix(prefix)
    if shard < 0:
        raise ValueError(f"a shard number is >= 0, got {shard}")
    tag = f"{{{prefix}:{shard}}}"
    return ShardKeys(lease=f"{tag}:lease", staging=f"{tag}:staging", leader=f"{tag}:leader")


def legacy_lease_key(prefix: str, shard: int) -> str:
    """The lease key of beats before hash tags (held too during an upgrade)."""
    return f"{prefix}:lease:{shard}"


def beats_key(prefix: str) -> str:
    """The sorted set of live beats under ``prefix`` (member: a beat's id,
    score: when its heartbeat expires, in Redis's milliseconds): how beats
    that share the shards find each other. One key, with a hash tag of its
    own, so its script is single-slot on a Cluster."""
    check_prefix(prefix)
    return f"{{{prefix}}}:beats"


def legacy_staging_key(prefix: str, shard: int) -> str:
    """The staging set of clients and leaders before hash tags."""
    return f"{prefix}:staging:{shard}"


def key_patterns(prefix: str) -> tuple[str, ...]:
    """SCAN ``MATCH`` patterns covering every key under ``prefix``, new and
    legacy (braces are not special in Redis glob patterns)."""
    return (f"{{{prefix}:*", f"{prefix}:*")
