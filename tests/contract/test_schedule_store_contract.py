"""The schedules part of the JobStore contract: memory and postgres alike."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any

import pytest

from celery_sched.errors import InvalidSchedule, ScheduleExists, UnknownSchedule
from celery_sched.interfaces import JobStore
from celery_sched.models import (
    JobStatus,
    NewJob,
    NewSchedule,
    ScheduleAdvance,
    StoredSchedule,
)
from tests.contract.conftest import due_of, new_job

SECOND = dt.timedelta(seconds=1)
MINUTE = dt.timedelta(minutes=1)


def new_schedule(name: str, next_at: dt.datetime | None, **fields: Any) -> NewSchedule:
    values: dict[str, Any] = {
        "task": "tests.add",
        "kind": "interval",
        "spec": {"seconds": 60.0},
        "body": json.dumps([[1, 2], {}, {}]).encode(),
        "content_type": "application/json",
        "content_encoding": "utf-8",
        "argsrepr": "(1, 2)",
        "kwargsrepr": "{}",
        "options": {"queue": "periodic"},
    }
    values.update(fields)
    return NewSchedule(name=name, next_nominal_at=next_at, **values)


def stored(store: JobStore, name: str) -> StoredSchedule:
    row = store.get_schedule(name)
    assert row is not None, name
    return row


def occurrence(row: StoredSchedule, due_at: dt.datetime, **fields: Any) -> NewJob:
    return new_job(f"{row.name}@{due_at.isoformat()}", due_at, schedule_id=row.id, **fields)


def advance(row: StoredSchedule, *jobs: NewJob, **fields: Any) -> ScheduleAdvance:
    last = max((job.due_at for job in jobs), default=row.next_nominal_at)
    values: dict[str, Any] = {
        "schedule_id": row.id,
        "version": row.version,
        "last_nominal_at": last,
        "next_nominal_at": None if last is None else last + MINUTE,
        "occurrences": jobs,
    }
    values.update(fields)
    return ScheduleAdvance(**values)


def keys_of(store: JobStore, row: StoredSchedule, *dues: dt.datetime) -> list[JobStatus | None]:
    statuses = []
    for due in dues:
        job = store.get(f"{row.name}@{due.isoformat()}")
        statuses.append(None if job is None else job.status)
    return statuses


# -- adding and reading --------------------------------------------------------------


def test_add_get_list_and_count(store: JobStore) -> None:
    now = store.now()
    assert store.add_schedules([new_schedule(n, now + MINUTE) for n in ("b", "a", "c")]) == 3
    row = stored(store, "a")
    assert row.version == 0 and not row.paused and row.enabled
    assert row.last_nominal_at is None
    assert row.next_nominal_at == now + MINUTE
    assert row.spec == {"seconds": 60.0} and row.options == {"queue": "periodic"}
    assert row.body == json.dumps([[1, 2], {}, {}]).encode()
    assert row.source == "dynamic" and row.overlap == "allow" and row.misfire is None
    assert row.created_at is not None and row.created_at.utcoffset() == dt.timedelta(0)
    assert store.get_schedule("nope") is None
    assert [s.name for s in store.list_schedules()] == ["a", "b", "c"]
    assert [s.name for s in store.list_schedules(after="a", limit=1)] == ["b"]
    assert store.count_schedules() == {"active": 3}
    by_id = store.schedules_by_id([row.id, stored(store, "c").id, row.id, 10**9])
    assert {s.name for s in by_id.values()} == {"a", "c"} and by_id[row.id] == row
    assert store.schedules_by_id([]) == {}


def test_a_taken_name_writes_nothing(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("taken", now)])
    with pytest.raises(ScheduleExists) as info:
        store.add_schedules([new_schedule("fresh", now), new_schedule("taken", now)])
    assert "taken" in str(info.value)
    assert store.get_schedule("fresh") is None
    with pytest.raises(InvalidSchedule):
        store.add_schedules([new_schedule("twice", now), new_schedule("twice", now)])
    assert store.get_schedule("twice") is None


# -- planning ---------------------------------------------------------------------------


def test_due_schedules_filters_orders_and_pages(store: JobStore) -> None:
    now = store.now()
    store.add_schedules(
        [
            new_schedule("late", now + 50 * SECOND),
            new_schedule("early", now + 10 * SECOND),
            new_schedule("beyond", now + 500 * SECOND),
            new_schedule("never", None),
            new_schedule("gone", now, enabled=False, source="static"),
        ]
    )
    store.add_schedules([new_schedule("paused", now)])
    store.set_schedule_paused("paused", True)
    horizon = now + 60 * SECOND
    due = store.due_schedules(horizon=horizon, shard=0, shards=1, limit=10)
    assert [s.name for s in due] == ["early", "late"]
    first = due[0]
    assert first.next_nominal_at is not None
    paged = store.due_schedules(
        horizon=horizon, shard=0, shards=1, limit=10, after=(first.next_nominal_at, first.id)
    )
    assert [s.name for s in paged] == ["late"]
    assert [s.name for s in store.due_schedules(horizon=horizon, shard=0, shards=1, limit=1)] == [
        "early"
    ]
    both = {s.name for s in store.due_schedules(horizon=horizon, shard=0, shards=2, limit=10)}
    both |= {s.name for s in store.due_schedules(horizon=horizon, shard=1, shards=2, limit=10)}
    assert both == {"early", "late"}
    one = {s.id % 2 for s in store.due_schedules(horizon=horizon, shard=1, shards=2, limit=10)}
    assert one <= {1}


def test_commit_plans_moves_cursor_and_inserts(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("s", now + 5 * SECOND)])
    row = stored(store, "s")
    t1, t2 = now + 5 * SECOND, now + 65 * SECOND
    result = store.commit_plans([advance(row, occurrence(row, t1), occurrence(row, t2))])
    assert sorted(due for _, due, _ in result.written) == [t1, t2]
    assert all(shard == 0 for _, _, shard in result.written)
    assert result.stale == 0 and result.busy == 0
    after = stored(store, "s")
    assert after.last_nominal_at == t2 and after.next_nominal_at == t2 + MINUTE
    assert after.version == row.version  # planning is not a change
    job = store.get(f"s@{t1.isoformat()}")
    assert job is not None and job.schedule_id == row.id and job.status == JobStatus.PENDING


def test_racing_planners_never_write_an_occurrence_twice(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("race", now + 5 * SECOND)])
    row = stored(store, "race")
    due = now + 5 * SECOND
    first = store.commit_plans([advance(row, occurrence(row, due))])
    # The other planner read the same version and built the same key (new id).
    second = store.commit_plans([advance(row, occurrence(row, due))])
    assert len(first.written) == 1
    assert second.written == []
    assert store.counts_by_status() == {JobStatus.PENDING: 1}


def test_a_slower_planner_never_moves_the_cursor_back(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("slow", now + 5 * SECOND)])
    read_early = stored(store, "slow")
    t1, t2 = now + 5 * SECOND, now + 65 * SECOND
    store.commit_plans(
        [advance(read_early, occurrence(read_early, t1), occurrence(read_early, t2))]
    )
    late = store.commit_plans([advance(read_early, occurrence(read_early, t1))])
    assert late.stale == 1 and late.written == []
    assert stored(store, "slow").last_nominal_at == t2


def test_commit_of_a_changed_schedule_is_stale(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("s", now + 5 * SECOND)])
    old = stored(store, "s")
    store.set_schedule_paused("s", True)
    store.set_schedule_paused("s", False)
    result = store.commit_plans([advance(old, occurrence(old, now + 5 * SECOND))])
    assert result.stale == 1 and result.written == []
    assert stored(store, "s").last_nominal_at is None
    store.set_schedule_paused("s", True)
    paused = stored(store, "s")
    result = store.commit_plans([advance(paused, occurrence(paused, now + 5 * SECOND))])
    assert result.stale == 1 and result.written == []


def test_busy_schedules_and_guarded_commit(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("o", now, overlap="skip"), new_schedule("p", now)])
    row, other = stored(store, "o"), stored(store, "p")
    assert store.busy_schedules([row.id, other.id]) == set()
    store.add_job(occurrence(row, now - 30 * SECOND))  # pending, due: unfinished
    assert store.busy_schedules([row.id, other.id]) == {row.id}
    result = store.commit_plans([advance(row, occurrence(row, now + SECOND), skip_if_busy=True)])
    assert result.written == [] and result.busy == 1
    assert stored(store, "o").last_nominal_at == now + SECOND  # skipped, cursor moved
    epoch = store.acquire_epoch(0, "t")
    [claimed] = store.claim_due(shard=0, epoch=epoch, limit=10)
    store.mark_finished(claimed.id, JobStatus.SUCCEEDED)
    assert store.busy_schedules([row.id]) == set()
    fresh = stored(store, "o")
    result = store.commit_plans(
        [advance(fresh, occurrence(fresh, now + 2 * SECOND), skip_if_busy=True)]
    )
    assert len(result.written) == 1


def test_a_missed_occurrence_does_not_make_its_schedule_busy(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("m", now, overlap="skip")])
    row = stored(store, "m")
    store.add_job(occurrence(row, now - 30 * SECOND))
    epoch = store.acquire_epoch(0, "t")
    [claimed] = store.claim_due(shard=0, epoch=epoch, limit=10)
    assert store.busy_schedules([row.id]) == {row.id}
    assert store.mark_missed([(claimed.id, "missed (test)")], epoch=epoch, due=due_of(claimed)) == [
        claimed.id
    ]
    assert store.busy_schedules([row.id]) == set()


# -- changes --------------------------------------------------------------------------------


def _planned(store: JobStore, name: str, *offsets: float) -> tuple[StoredSchedule, list[Any]]:
    """Schedule ``name`` with occurrences at now + each offset, committed by a planner."""
    now = store.now()
    store.add_schedules([new_schedule(name, now + offsets[0] * SECOND)])
    row = stored(store, name)
    dues = [now + offset * SECOND for offset in offsets]
    store.commit_plans([advance(row, *(occurrence(row, due) for due in dues))])
    return stored(store, name), dues


def test_pause_withdraws_future_occurrences_and_rolls_back(store: JobStore) -> None:
    row, dues = _planned(store, "p", -20, 30, 90)
    paused = store.set_schedule_paused("p", True)
    assert paused.paused and paused.version == row.version + 1
    # The overdue one stays (it fires); the future ones are gone, keys free.
    assert keys_of(store, row, *dues) == [JobStatus.PENDING, None, None]
    assert paused.last_nominal_at is None and paused.next_nominal_at == dues[1]
    assert store.count_schedules() == {"paused": 1}
    assert store.set_schedule_paused("p", True).version == paused.version  # no change
    resumed = store.set_schedule_paused("p", False)
    assert not resumed.paused and resumed.version == paused.version + 1
    assert resumed.next_nominal_at == dues[1]  # the time paused counts as missed
    with pytest.raises(UnknownSchedule):
        store.set_schedule_paused("nope", True)


def test_replace_restarts_or_rolls_back(store: JobStore) -> None:
    row, dues = _planned(store, "r", 30, 90)
    new_next = store.now() + 600 * SECOND
    changed = dataclasses.replace(
        row.as_new(), spec={"seconds": 600.0}, options={"queue": "other"}, next_nominal_at=new_next
    )
    assert store.replace_schedule(changed, expected_version=row.version + 7, restart=True) is None
    assert keys_of(store, row, *dues) == [JobStatus.PENDING, JobStatus.PENDING]
    replaced = store.replace_schedule(changed, expected_version=row.version, restart=True)
    assert replaced is not None
    assert replaced.spec == {"seconds": 600.0} and replaced.options == {"queue": "other"}
    assert replaced.last_nominal_at is None and replaced.next_nominal_at == new_next
    assert replaced.version == row.version + 1 and replaced.source == "dynamic"
    assert keys_of(store, row, *dues) == [None, None]

    row2, dues2 = _planned(store, "r2", 30, 90)
    args_only = dataclasses.replace(row2.as_new(), body=b"[[3], {}, {}]", argsrepr="(3,)")
    rolled = store.replace_schedule(args_only, expected_version=row2.version, restart=False)
    assert rolled is not None and rolled.body == b"[[3], {}, {}]"
    assert rolled.last_nominal_at is None and rolled.next_nominal_at == dues2[0]
    with pytest.raises(UnknownSchedule):
        store.replace_schedule(
            dataclasses.replace(args_only, name="nope"), expected_version=0, restart=True
        )


def test_delete_keeps_history_and_due_occurrences(store: JobStore) -> None:
    row, dues = _planned(store, "d", -20, 30)
    assert store.delete_schedule("d") is True
    assert store.get_schedule("d") is None
    assert keys_of(store, row, *dues) == [JobStatus.PENDING, None]
    assert store.delete_schedule("d") is False


def test_trigger_respects_running_occurrences_only(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("t", now + MINUTE, overlap="skip")])
    row = stored(store, "t")
    store.commit_plans([advance(row, occurrence(row, now + 30 * SECOND))])
    # A pending occurrence not yet due does not block a trigger.
    job = store.trigger_occurrence(occurrence(row, now), skip_if_busy=True)
    assert job is not None and job.schedule_id == row.id and job.due_at == now
    # The triggered one is now due and unfinished: the next trigger is refused.
    assert store.trigger_occurrence(occurrence(row, now + SECOND), skip_if_busy=True) is None
    again = store.trigger_occurrence(occurrence(row, now + SECOND), skip_if_busy=False)
    assert again is not None
    same = store.trigger_occurrence(occurrence(row, now), skip_if_busy=False)
    assert same is not None and same.id == job.id  # existing key: the stored job
    store.delete_schedule("t")
    with pytest.raises(UnknownSchedule):
        store.trigger_occurrence(occurrence(row, now + 2 * SECOND), skip_if_busy=False)


def test_schedule_runs_next_and_last(store: JobStore) -> None:
    row, dues = _planned(store, "runs", -40, -20, 30, 90)
    epoch = store.acquire_epoch(0, "t")
    store.claim_due(shard=0, epoch=epoch, limit=1)  # the -40 one
    runs = store.schedule_runs([row.id, 12345])
    assert set(runs) == {row.id}
    assert runs[row.id].next_due_at == dues[2]
    assert runs[row.id].last_due_at == dues[1]
    assert runs[row.id].last_status == JobStatus.PENDING


# -- the static sync ---------------------------------------------------------------------


def test_static_sync(store: JobStore) -> None:
    now = store.now()
    first = now + MINUTE
    store.add_schedules([new_schedule("mine", first)])  # dynamic
    result = store.sync_static_schedules(
        [
            new_schedule("keep", first, source="static"),
            new_schedule("args", first, source="static"),
            new_schedule("timing", first, source="static"),
            new_schedule("drop", first, source="static"),
            new_schedule("mine", first, source="static", task="tests.other"),
        ]
    )
    assert (result.added, result.updated, result.disabled) == (4, 0, 0)
    assert result.conflicts == ("mine",)
    assert stored(store, "keep").source == "static"
    plans = {}
    for name in ("keep", "args", "timing", "drop"):
        row = stored(store, name)
        dues = [now + 30 * SECOND, now + 90 * SECOND]
        store.commit_plans([advance(row, *(occurrence(row, due) for due in dues))])
        plans[name] = (stored(store, name), dues)
    store.set_schedule_paused("keep", True)
    store.set_schedule_paused("keep", False)
    kept = stored(store, "keep")

    later = now + 10 * MINUTE
    result = store.sync_static_schedules(
        [
            new_schedule("keep", later, source="static"),
            new_schedule("args", later, source="static", argsrepr="(9,)", body=b"[[9], {}, {}]"),
            new_schedule("timing", later, source="static", spec={"seconds": 5.0}),
            new_schedule("mine", later, source="static", task="tests.other"),
        ]
    )
    assert (result.added, result.updated, result.disabled, result.unchanged) == (0, 2, 1, 1)
    assert result.conflicts == ("mine",)
    # Unchanged: cursor, version and occurrences untouched.
    assert stored(store, "keep") == kept
    # A changed argument: future occurrences withdrawn, cursor rolled back.
    row, dues = plans["args"]
    args = stored(store, "args")
    assert args.body == b"[[9], {}, {}]" and args.version == row.version + 1
    assert args.last_nominal_at is None and args.next_nominal_at == dues[0]
    assert keys_of(store, row, *dues) == [None, None]
    # A timing change restarts from the new first instant.
    timing = stored(store, "timing")
    assert timing.spec == {"seconds": 5.0}
    assert timing.last_nominal_at is None and timing.next_nominal_at == later
    # Gone from the code: disabled, history kept, future withdrawn.
    row, dues = plans["drop"]
    drop = stored(store, "drop")
    assert not drop.enabled and drop.disabled_at is not None
    assert keys_of(store, row, *dues) == [None, None]
    # The dynamic schedule of the same name is untouched.
    mine = stored(store, "mine")
    assert mine.source == "dynamic" and mine.task == "tests.add" and mine.enabled

    # Back in the code: enabled again, restarted.
    back = now + 20 * MINUTE
    result = store.sync_static_schedules(
        [
            new_schedule("keep", later, source="static"),
            new_schedule("drop", back, source="static"),
        ]
    )
    drop = stored(store, "drop")
    assert drop.enabled and drop.disabled_at is None and drop.next_nominal_at == back
    assert result.disabled == 2  # args and timing are gone now


def test_static_sync_keeps_pause(store: JobStore) -> None:
    now = store.now()
    store.sync_static_schedules([new_schedule("s", now + MINUTE, source="static")])
    store.set_schedule_paused("s", True)
    store.sync_static_schedules(
        [new_schedule("s", now + MINUTE, source="static", options={"queue": "x"})]
    )
    row = stored(store, "s")
    assert row.paused and row.options == {"queue": "x"}


# -- broken schedules ---------------------------------------------------------------------


def test_a_broken_schedule_is_left_out_of_planning_and_counted(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("ok", now), new_schedule("bad", now)])
    bad = stored(store, "bad")
    assert store.mark_schedule_broken(bad.id, version=bad.version, reason="OverflowError: x")
    row = stored(store, "bad")
    assert row.broken_reason == "OverflowError: x" and row.broken_at is not None
    assert abs((row.broken_at - store.now()).total_seconds()) < 5  # the store's clock
    assert row.version == bad.version  # planning state, not a change
    assert row.next_nominal_at == bad.next_nominal_at  # the cursor stays for a retry
    due = store.due_schedules(horizon=now + MINUTE, shard=0, shards=1, limit=10)
    assert [s.name for s in due] == ["ok"]
    assert store.count_schedules() == {"active": 1, "broken": 1}
    # Marked once: a second planner that read the same version changes nothing.
    assert not store.mark_schedule_broken(bad.id, version=bad.version, reason="again")
    assert stored(store, "bad").broken_reason == "OverflowError: x"
    # A plan made from a broken row (an older leader) is stale.
    result = store.commit_plans([advance(bad, occurrence(bad, now + SECOND))])
    assert result.stale == 1 and result.written == []
    assert not store.mark_schedule_broken(987654, version=0, reason="gone")
    # Paused or disabled wins in the count: one state per schedule.
    store.set_schedule_paused("bad", True)
    assert store.count_schedules() == {"active": 1, "paused": 1}
    assert stored(store, "bad").broken_at is not None  # a pause keeps the reason


def test_marking_broken_is_fenced_by_the_version(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule("s", now)])
    read = stored(store, "s")
    fixed = dataclasses.replace(read.as_new(), options={"queue": "fixed"})
    assert store.replace_schedule(fixed, expected_version=read.version, restart=False)
    assert not store.mark_schedule_broken(read.id, version=read.version, reason="old")
    row = stored(store, "s")
    assert row.broken_at is None and row.broken_reason is None


def test_a_user_change_clears_the_broken_mark(store: JobStore) -> None:
    now = store.now()
    store.add_schedules([new_schedule(n, now) for n in ("replaced", "resumed", "paused")])

    def broken(name: str) -> StoredSchedule:
        row = stored(store, name)
        assert store.mark_schedule_broken(row.id, version=row.version, reason="bad")
        return stored(store, name)

    row = broken("replaced")
    new = dataclasses.replace(row.as_new(), options={"queue": "other"})
    replaced = store.replace_schedule(new, expected_version=row.version, restart=False)
    assert replaced is not None and replaced.broken_at is None
    assert replaced.broken_reason is None
    # Resuming retries a broken schedule that was never paused, too.
    row = broken("resumed")
    resumed = store.set_schedule_paused("resumed", False)
    assert resumed.broken_at is None and resumed.broken_reason is None
    assert resumed.version == row.version + 1 and not resumed.paused
    row = broken("paused")
    store.set_schedule_paused("paused", True)
    resumed = store.set_schedule_paused("paused", False)
    assert resumed.broken_at is None and not resumed.paused
    due = store.due_schedules(horizon=now + MINUTE, shard=0, shards=1, limit=10)
    assert {s.name for s in due} == {"replaced", "resumed", "paused"}
    assert store.count_schedules() == {"active": 3}


def test_static_sync_clears_the_broken_mark_only_on_a_change(store: JobStore) -> None:
    now = store.now()
    defined = [
        new_schedule("same", now, source="static"),
        new_schedule("args", now, source="static"),
        new_schedule("timing", now, source="static"),
    ]
    store.sync_static_schedules(defined)
    for name in ("same", "args", "timing"):
        row = stored(store, name)
        assert store.mark_schedule_broken(row.id, version=row.version, reason="bad")
    store.sync_static_schedules(
        [
            new_schedule("same", now, source="static"),
            new_schedule("args", now, source="static", argsrepr="(9,)", body=b"[[9], {}, {}]"),
            new_schedule("timing", now, source="static", spec={"seconds": 5.0}),
        ]
    )
    assert stored(store, "same").broken_reason == "bad"
    assert stored(store, "args").broken_at is None and stored(store, "args").broken_reason is None
    assert stored(store, "timing").broken_at is None
    assert store.count_schedules() == {"active": 2, "broken": 1}


@pytest.mark.parametrize("overlap", ["allow", "skip"])
@pytest.mark.parametrize("misfire", [None, "skip", "once", "all"])
def test_every_policy_value_is_stored(store: JobStore, misfire: str | None, overlap: str) -> None:
    # The schedules table's CHECK constraints must accept what the code writes.
    now = store.now()
    store.add_schedules([new_schedule("p", now, misfire=misfire, overlap=overlap)])
    store.sync_static_schedules([new_schedule("q", now, misfire=misfire, overlap=overlap)])
    for name in ("p", "q"):
        row = stored(store, name)
        assert (row.misfire, row.overlap) == (misfire, overlap)


@pytest.mark.parametrize("fields", [{"misfire": "sometimes"}, {"overlap": "never"}])
def test_a_policy_the_table_refuses_is_refused_before_any_write(
    store: JobStore, fields: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=r"sometimes|never"):
        store.add_schedules([new_schedule("bad", store.now(), **fields)])
    assert store.list_schedules() == []
