"""Which beat should lead which shard: a pure function of the live beats.

Every beat that shares the shards (no ``celery_sched_shard`` pin) reads the
same sorted list of live beats (:mod:`celery_sched.lease.membership`) and
computes the same answer, so no beat has to tell another what to do:

* each beat gets ``floor(S / N)`` or ``ceil(S / N)`` of the ``S`` shards
  (``N`` live beats), so the spread is within 1 of even and no beat leads more
  than ``ceil(S / N)``;
* a shard stays with the live beat that leads it now while that beat has
  room (so a standby joining does not move a shard that is led, and a beat
  joining a fleet takes only its share);
* the other shards, shard by shard, go to the best-ranked beat that still has
  room, the beats ranked by a hash of ``(beat, shard)`` (rendezvous hashing),
  so where the shards go does not depend on the order beats started in.

The answer is advice. Until the beats agree again (a beat joined, one died,
one cannot reach Redis) two of them may compete for one shard, which the
lease settles; the PostgreSQL epoch fences whatever the lease cannot.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

__all__ = ["assign", "cap", "shards_of"]


def cap(shards: int, beats: int) -> int:
    """The most shards one of ``beats`` live beats leads: ``ceil(shards / beats)``."""
    if beats < 1:
        raise ValueError("at least one beat shares the shards")
    return -(-shards // beats)


def _rank(beat: str, shard: int) -> bytes:
    # Stable across processes and Python versions (unlike hash()).
    return hashlib.blake2b(f"{beat}\x00{shard}".encode(), digest_size=8).digest()


def assign(
    shards: int, beats: Sequence[str], leaders: Mapping[int, str] | None = None
) -> dict[int, str]:
    """``shard -> beat`` for shards ``0 .. shards - 1`` over ``beats`` (ids,
    in any order; duplicates count once). ``leaders`` maps shards to the beat
    leading them now (beats not in ``beats`` are ignored). Empty when there is
    no beat."""
    if shards < 1:
        raise ValueError(f"there is at least one shard, got {shards}")
    live = sorted(set(beats))
    if not live:
        return {}
    base, extra = divmod(shards, len(live))
    counts = dict.fromkeys(live, 0)
    # Beats that already have base + 1 shards; at most ``extra`` may.
    full = 0

    def take(beat: str) -> bool:
        nonlocal full
        count = counts[beat]
        if count < base or (count == base and full < extra):
            full += count == base
            counts[beat] = count + 1
            return True
        return False

    owners: dict[int, str] = {}
    for shard in range(shards):
        leader = (leaders or {}).get(shard)
        if leader in counts and take(leader):
            owners[shard] = leader
    for shard in range(shards):
        if shard in owners:
            continue
        for beat in sorted(live, key=lambda b: _rank(b, shard), reverse=True):
            if take(beat):
                owners[shard] = beat
                break
    return owners


def shards_of(owners: Mapping[int, str], beat: str) -> set[int]:
    """The shards ``owners`` gives to ``beat``."""
    return {shard for shard, owner in owners.items() if owner == beat}
