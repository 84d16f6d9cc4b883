"""Who should lead which shard (:func:`celery_sched.leader.balancing.assign`)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from celery_sched.leader.balancing import assign, cap, shards_of


@pytest.mark.parametrize("shards", [1, 2, 7, 16, 64])
@pytest.mark.parametrize("beats", [1, 2, 3, 5, 16, 70])
def test_every_shard_has_one_beat_and_the_spread_is_within_one(shards: int, beats: int) -> None:
    ids = [f"host-{n}:{1000 + n}:{n:08x}" for n in range(beats)]
    owners = assign(shards, ids)
    assert sorted(owners) == list(range(shards))
    per_beat = Counter(owners.values())
    counts = [per_beat.get(beat, 0) for beat in ids]
    assert max(counts) - min(counts) <= 1
    assert max(counts) <= cap(shards, beats)
    assert sum(counts) == shards


def test_the_answer_depends_on_the_set_of_beats_only() -> None:
    ids = [f"b{n}" for n in range(5)]
    shuffled = ids[:]
    random.Random(7).shuffle(shuffled)
    assert assign(16, ids) == assign(16, shuffled) == assign(16, ids + ids[:2])


def test_a_beat_joining_or_leaving_moves_few_shards() -> None:
    three = assign(16, ["a", "b", "c"])
    four = assign(16, ["a", "b", "c", "d"])
    moved_on_join = sum(three[s] != four[s] for s in range(16))
    # The newcomer needs 4 shards; rendezvous ranking moves about that many,
    # not a reshuffle of all 16.
    assert 4 <= moved_on_join <= 6
    assert len(shards_of(four, "d")) == 4
    two = assign(16, ["a", "b"])
    moved_on_leave = sum(three[s] != two[s] for s in range(16))
    # c's shards (5 or 6) must move; a few more may, to keep the spread even.
    assert len(shards_of(three, "c")) <= moved_on_leave <= 8


def test_different_beats_get_different_shards_across_many_fleets() -> None:
    # Not every fleet gives shard 0 to the same-named beat: the ranking is a
    # hash of (beat, shard), so shard 0's extra duties spread over beats too.
    firsts = {assign(4, [f"x{n}", f"y{n}"])[0][0] for n in range(40)}
    assert firsts == {"x", "y"}


def test_no_beat_no_owner_and_bad_counts_are_refused() -> None:
    assert assign(4, []) == {}
    with pytest.raises(ValueError, match="at least one shard"):
        assign(0, ["a"])
    with pytest.raises(ValueError, match="at least one beat"):
        cap(4, 0)
    assert [cap(16, n) for n in (1, 2, 3, 4, 5)] == [16, 8, 6, 4, 4]


def test_shards_of_lists_a_beats_shards() -> None:
    owners = assign(8, ["a", "b"])
    mine, theirs = shards_of(owners, "a"), shards_of(owners, "b")
    assert mine | theirs == set(range(8)) and not mine & theirs
    assert shards_of(owners, "nobody") == set()
    assert len(mine) == len(theirs) == 4


def test_a_shard_stays_with_its_leader_while_that_beat_has_room() -> None:
    # One shard, a standby joins: whichever beat the hash prefers, the
    # leader keeps the shard.
    for leader in ("a", "b"):
        assert assign(1, ["a", "b"], {0: leader}) == {0: leader}
    # A beat leading every shard when three more join keeps four of them;
    # the others go to the newcomers, four each.
    owners = assign(16, ["a", "b", "c", "d"], dict.fromkeys(range(16), "a"))
    assert Counter(owners.values()) == {"a": 4, "b": 4, "c": 4, "d": 4}
    assert all(owners[s] == "a" for s in range(4))
    # A leader that is not live is ignored.
    assert assign(2, ["a", "b"], {0: "gone", 1: "gone"}) == assign(2, ["a", "b"])
