"""The extra load of the soak's ``dense`` and ``clients`` modes.

``dense_rows`` lays out jobs over 150+ partitions of ``jobs`` (a few due
now, most days, months and years ahead), scheduled up front. ``ClientLoad``
runs API clients in threads, three per connection of the store pool, that
share one :class:`~celery_sched.client.Client` (one pool) while the faults
run: single schedules, ``schedule_many`` bulk loads (some into partitions
nobody made yet), cancels and gets, in rounds that all threads start at
once so that the pool is contended. What each client saw joins the
checker's manifest: jobs that must run, jobs cancelled (must not run), jobs
due after the soak (must stay pending), and its own problems (a call that
gave up, never returned, or a ``get`` that answered wrong).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime as dt
import random
import sys
import threading
import time
import traceback
from typing import Any

from celery_sched.errors import CelerySchedError
from celery_sched.store.partitions import range_for

#: Seconds a client thread waits for the others at the start of a round.
ROUND_WAIT = 30.0
#: A job due this much after the soak is never dispatched during it.
FUTURE = dt.timedelta(days=40)


def dense_rows(
    now: dt.datetime, rng: random.Random, tasks: tuple[str, ...], *, ranges: int
) -> list[dict[str, Any]]:
    """Two jobs in each of ``ranges`` distinct partition ranges (as of ``now``):
    the last three days (due, so they run at once), then every day of the
    daily band ahead, the months of the monthly band, and years beyond."""
    candidates: list[dt.datetime] = []
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    candidates += [day - dt.timedelta(days=k) for k in (3, 2, 1)]
    candidates += [day + dt.timedelta(days=k) for k in range(1, 40)]
    candidates += [
        dt.datetime(
            now.year + (now.month + m - 1) // 12, (now.month + m - 1) % 12 + 1, 10, tzinfo=dt.UTC
        )
        for m in range(1, 16)
    ]
    candidates += [dt.datetime(now.year + y, 4, 10, tzinfo=dt.UTC) for y in range(1, 400)]
    seen: set[Any] = set()
    rows: list[dict[str, Any]] = []
    for base in candidates:
        at = base + dt.timedelta(hours=rng.randint(1, 21), minutes=rng.randint(0, 58))
        part = range_for(at, now)
        if part in seen:
            continue
        seen.add(part)
        for offset in (0, 1):
            rows.append(
                {
                    "task": rng.choice(tasks),
                    "args": (0.0,),
                    "eta": at + dt.timedelta(minutes=offset),
                    "key": f"dense-{len(rows):06d}",
                    "max_attempts": 50,
                }
            )
        if len(seen) >= ranges:
            break
    return rows


@dataclasses.dataclass
class ClientLoad:
    """API clients in ``threads`` threads sharing ``client`` until ``stop_at``."""

    client: Any
    threads: int
    tasks: tuple[str, ...]
    seed: float
    stop_at: float
    jobs: dict[str, str] = dataclasses.field(default_factory=dict)
    cancelled: dict[str, str] = dataclasses.field(default_factory=dict)
    future: dict[str, str] = dataclasses.field(default_factory=dict)
    problems: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ops: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    #: The latest due time (epoch) of a job that must run.
    last_due: float = 0.0
    seconds: list[float] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _running: list[threading.Thread] = dataclasses.field(default_factory=list)

    def start(self) -> None:
        barrier = threading.Barrier(self.threads)
        for index in range(self.threads):
            thread = threading.Thread(
                target=self._client, args=(index, barrier), name=f"soak-client-{index}", daemon=True
            )
            thread.start()
            self._running.append(thread)

    def join(self, timeout: float) -> bool:
        """Wait for every thread; a thread still in a call after ``timeout``
        is a ``client_hung`` problem with its stack. True if none hung."""
        deadline = time.time() + timeout
        for thread in self._running:
            thread.join(max(0.0, deadline - time.time()))
        frames = sys._current_frames()
        hung = [t for t in self._running if t.is_alive()]
        for thread in hung:
            frame = frames.get(thread.ident or -1)
            stack = traceback.format_stack(frame)[-12:] if frame is not None else []
            self.problems.append(
                {
                    "invariant": "client_hung",
                    "job": thread.name,
                    "stack": "".join(stack)[-3000:],
                }
            )
        return not hung

    def figures(self) -> dict[str, Any]:
        ordered = sorted(self.seconds)
        return {
            "threads": self.threads,
            "calls": dict(sorted(self.ops.items())),
            "call_p99_s": round(ordered[int(0.99 * (len(ordered) - 1))], 3) if ordered else None,
            "call_max_s": round(ordered[-1], 3) if ordered else None,
        }

    # -- one client thread ----------------------------------------------------

    def _client(self, index: int, barrier: threading.Barrier) -> None:
        rng = random.Random(self.seed + index)
        mine: list[str] = []
        cancellable: list[tuple[str, float]] = []
        serial = 0
        first = True
        while time.time() < self.stop_at:
            # Every thread calls at the same instant, the first time with a
            # bulk load into partitions nobody has made yet.
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(ROUND_WAIT)
            if time.time() >= self.stop_at:
                break
            op = "schedule_many" if first else self._pick(rng, cancellable)
            first = False
            started = time.monotonic()
            if op == "schedule":
                serial += 1
                self._schedule(rng, f"client-{index:02d}-{serial:05d}", mine, cancellable)
            elif op == "schedule_many":
                count = rng.randint(5, 15)
                keys = [f"client-{index:02d}-{serial + n + 1:05d}" for n in range(count)]
                serial += count
                self._schedule_many(rng, keys, mine)
            elif op == "cancel":
                self._cancel(cancellable.pop(rng.randrange(len(cancellable)))[0])
            else:
                self._get(rng.choice(mine))
            with self._lock:
                self.ops[op] += 1
                self.seconds.append(time.monotonic() - started)
            time.sleep(rng.uniform(1.0, 3.0))

    def _pick(self, rng: random.Random, cancellable: list[tuple[str, float]]) -> str:
        # Only a job still well ahead of its due time is worth cancelling:
        # one the beat may be claiming is allowed to run.
        now = time.time()
        cancellable[:] = [(k, due) for k, due in cancellable if due > now + 5]
        roll = rng.random()
        if roll < 0.30:
            return "schedule"
        if roll < 0.45:
            return "schedule_many"
        if roll < 0.65 and cancellable:
            return "cancel"
        return "get"

    def _call(self, what: str, key: str, call: Any) -> tuple[bool, Any]:
        """``call()`` with retries through faults; (done, its result)."""
        error = ""
        for _attempt in range(20):
            try:
                return True, call()
            except CelerySchedError as exc:
                error = f"{type(exc).__name__}: {exc}"
                time.sleep(0.5)
        self._problem("client_failed", key, call=what, error=error[:300])
        return False, None

    def _problem(self, invariant: str, key: str, **detail: Any) -> None:
        with self._lock:
            self.problems.append({"invariant": invariant, "job": key, **detail})

    def _schedule(
        self, rng: random.Random, key: str, mine: list[str], cancellable: list[tuple[str, float]]
    ) -> None:
        task = rng.choice(self.tasks)
        later = rng.random() < 0.4
        countdown = rng.uniform(20.0, 40.0) if later else rng.uniform(0.0, 8.0)
        due = time.time() + countdown
        done, _job = self._call(
            "schedule",
            key,
            lambda: self.client.schedule(
                task,
                args=(0.0,),
                countdown=countdown,
                key=key,
                max_attempts=50,
                if_exists="return",
            ),
        )
        if not done:
            return
        with self._lock:
            self.jobs[key] = task
            self.last_due = max(self.last_due, due)
        mine.append(key)
        if later:
            cancellable.append((key, due))

    def _schedule_many(self, rng: random.Random, keys: list[str], mine: list[str]) -> None:
        now = dt.datetime.now(dt.UTC)
        rows: list[dict[str, Any]] = []
        due: dict[str, float] = {}
        for key in keys:
            task = rng.choice(self.tasks)
            if rng.random() < 0.5:
                countdown = rng.uniform(0.0, 10.0)
                due[key] = time.time() + countdown
                rows.append({"task": task, "args": (0.0,), "countdown": countdown, "key": key})
            else:
                # Days to centuries ahead: partitions no one has made yet.
                eta = (
                    now
                    + FUTURE
                    + dt.timedelta(days=rng.randint(0, 40_000), hours=rng.randint(0, 23))
                )
                rows.append({"task": task, "args": (0.0,), "eta": eta, "key": key})
            rows[-1]["max_attempts"] = 50

        def load() -> int:
            try:
                return int(self.client.schedule_many(rows))
            except CelerySchedError:
                # All or nothing: a commit whose answer was lost left the
                # first key behind, and a retry would be refused as a duplicate.
                if self.client.get(keys[0]) is not None:
                    return len(rows)
                raise

        done, _count = self._call("schedule_many", keys[0], load)
        if not done:
            return
        with self._lock:
            for row in rows:
                key = row["key"]
                if key in due:
                    self.jobs[key] = row["task"]
                    self.last_due = max(self.last_due, due[key])
                else:
                    self.future[key] = row["task"]
        mine.extend(keys)

    def _cancel(self, key: str) -> None:
        done, cancelled = self._call("cancel", key, lambda: self.client.cancel(key))
        if done and not cancelled:
            # A retry after a cancel whose answer was lost finds it no longer pending.
            done, job = self._call("get", key, lambda: self.client.get(key))
            cancelled = job is not None and str(job.status) == "cancelled"
        if done and cancelled:
            with self._lock:
                self.cancelled[key] = self.jobs.pop(key)

    def _get(self, key: str) -> None:
        done, job = self._call("get", key, lambda: self.client.get(key))
        if not done:
            return
        with self._lock:
            expected = (
                "cancelled" if key in self.cancelled else "pending" if key in self.future else None
            )
        status = None if job is None else str(job.status)
        if job is None or (expected is not None and status != expected):
            self._problem("client_get_wrong", key, status=status, expected=expected or "a job")
