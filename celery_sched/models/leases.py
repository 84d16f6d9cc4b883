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
