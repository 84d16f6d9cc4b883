"""The leader lease of a shard, as held."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Lease:
    """A held leader lease for one shard.

    ``valid_until`` is a ``time.monotonic()`` deadline taken *before* the
    SET was sent, minus a safety margin: past it the holder must stop
    claiming even if no renewal has failed yet.
    """

    shard: int
    token: str
    epoch: int
    valid_until: float


#: The low bits of an epoch, drawn at random at each election.
EPOCH_SALT_BITS = 24
#: The salt part of an epoch.
EPOCH_SALT_MASK = (1 << EPOCH_SALT_BITS) - 1


def next_epoch(previous: int, salt: int) -> int:
    """The epoch of the election after ``previous`` (0: the first), with
    ``salt`` (random) in its low :data:`EPOCH_SALT_BITS` bits.

    The fence compares epochs for equality, so two terms must never share
    one. A counter alone can repeat: after a failover of an asynchronously
    replicated PostgreSQL, the promoted replica may lack the last bump and
    hand its number out again while the leader of that lost term still
    holds it. With random low bits the two differ (but for a chance of one
    in 2**24 per such failover), and epochs still only grow.
    """
    return (((previous >> EPOCH_SALT_BITS) + 1) << EPOCH_SALT_BITS) | (salt & EPOCH_SALT_MASK)


def election_count(epoch: int) -> int:
    """How many elections of its shard ``epoch`` follows (its counter part)."""
    return epoch >> EPOCH_SALT_BITS
