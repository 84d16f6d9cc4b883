"""Periodic schedules as values: the spec a user defines, the rows the store
keeps, the planner's steps and what users see (the pure logic lives in
:mod:`celery_sched.schedules`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from celery_sched.errors import InvalidSchedule
from celery_sched.models.checks import DUE_LIMIT, MAX_INT32, MAX_SECONDS, check_aware
from celery_sched.models.jobs import JobStatus, NewJob
from celery_sched.timeutil import get_zone


class MisfirePolicy(enum.StrEnum):
    """What happens to occurrences missed while no planner ran."""

    SKIP = "skip"  # drop them; run only future occurrences
    ONCE = "once"  # run the latest missed occurrence once (beat's behaviour)
    ALL = "all"  # run each missed one within the catch-up window, up to a maximum count


class OverlapPolicy(enum.StrEnum):
    """Whether an occurrence may start while the previous one is unfinished."""

    ALLOW = "allow"
    SKIP = "skip"  # no new occurrence while the previous is pending, dispatched or running


#: Mirrors ``celery_sched.store.schema.SCHEDULE_KINDS`` (the table's CHECK
#: constraint); models must not import the store, a unit test keeps them equal.
SCHEDULE_KINDS = frozenset({"crontab", "interval", "solar", "clocked", "custom"})
SCHEDULE_SOURCES = frozenset({"static", "dynamic"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    """A periodic schedule as stored in ``schedules``: what runs, and when.

    ``spec`` is the JSON-able definition of the ``kind``:

    - ``crontab``: ``{"minute", "hour", "day_of_week", "day_of_month", "month_of_year"}``,
      each a Celery cron field string, evaluated on the wall clock of ``timezone``;
    - ``interval``: ``{"seconds": float}`` (positive);
    - ``solar``: ``{"event", "lat", "lon"}`` as :class:`celery.schedules.solar` takes them;
    - ``clocked``: ``{"at": "<ISO 8601 UTC>"}``, a one-off.

    Construction checks the generic fields (name, task, kind, timezone,
    policies, numbers) and raises :class:`~celery_sched.errors.InvalidSchedule`
    or :class:`~celery_sched.errors.UnknownTimezone`; the definition itself is
    checked by :func:`celery_sched.schedules.make_spec`. ``None`` policies and
    catch-up limits mean "the project default" (settings).
    """

    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    timezone: str = "UTC"
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    misfire: MisfirePolicy | None = None
    overlap: OverlapPolicy = OverlapPolicy.ALLOW
    catchup_window: float | None = None
    max_catchup: int | None = None
    relative: bool = False
    enabled: bool = True
    source: str = "dynamic"

    def __post_init__(self) -> None:
        if type(self.name) is not str or not self.name.strip():
            raise InvalidSchedule(f"schedule name must be a non-empty string, got {self.name!r}")
        what = f"schedule {self.name!r}"
        if type(self.task) is not str or not self.task:
            raise InvalidSchedule(f"{what}: task must be a non-empty string, got {self.task!r}")
        if self.kind not in SCHEDULE_KINDS:
            raise InvalidSchedule(
                f"{what}: unknown schedule kind {self.kind!r}; "
                f"expected one of {', '.join(sorted(SCHEDULE_KINDS))}"
            )
        if not isinstance(self.spec, Mapping):
            raise InvalidSchedule(f"{what}: spec must be a mapping, got {type(self.spec).__name__}")
        if type(self.timezone) is not str:
            raise InvalidSchedule(f"{what}: timezone must be an IANA name, got {self.timezone!r}")
        get_zone(self.timezone)  # raises UnknownTimezone
        if self.source not in SCHEDULE_SOURCES:
            raise InvalidSchedule(
                f"{what}: source must be 'static' or 'dynamic', got {self.source!r}"
            )
        for name in ("relative", "enabled"):
            if type(getattr(self, name)) is not bool:
                raise InvalidSchedule(f"{what}: {name} must be a bool")
        try:
            if self.misfire is not None:
                object.__setattr__(self, "misfire", MisfirePolicy(self.misfire))
        except ValueError:
            raise InvalidSchedule(
                f"{what}: unknown misfire policy {self.misfire!r}; expected skip, once or all"
            ) from None
        try:
            object.__setattr__(self, "overlap", OverlapPolicy(self.overlap))
        except ValueError:
            raise InvalidSchedule(
                f"{what}: unknown overlap policy {self.overlap!r}; expected allow or skip"
            ) from None
        window = self.catchup_window
        if window is not None:
            if (
                type(window) is bool
                or not isinstance(window, (int, float))
                or not 0 <= window <= MAX_SECONDS
            ):
                raise InvalidSchedule(
                    f"{what}: catchup_window must be a number of seconds from 0 to "
                    f"{MAX_SECONDS:.0f} (1000 years), got {window!r}"
                )
            object.__setattr__(self, "catchup_window", float(window))
        count = self.max_catchup
        if count is not None and (type(count) is not int or not 0 <= count <= MAX_INT32):
            raise InvalidSchedule(
                f"{what}: max_catchup must be an integer from 0 to {MAX_INT32}, got {count!r}"
            )
        if isinstance(self.spec, Mapping):
            _check_plannable(what, self.kind, self.spec)
        if not isinstance(self.args, tuple):
            if not isinstance(self.args, list):
                raise InvalidSchedule(f"{what}: args must be a list or tuple")
            object.__setattr__(self, "args", tuple(self.args))
        for name in ("kwargs", "options"):
            if not isinstance(getattr(self, name), Mapping):
                raise InvalidSchedule(f"{what}: {name} must be a mapping")


def _check_plannable(what: str, kind: str, spec: Mapping[str, Any]) -> None:
    """Refuse definition values the store cannot hold or the planner cannot
    compute with (the definition's shape is checked by ``schedules.make_spec``)."""
    if kind == "interval":
        seconds = spec.get("seconds")
        # Only the upper bound here (and NaN); make_spec refuses the rest.
        if (
            isinstance(seconds, (int, float))
            and type(seconds) is not bool
            and not seconds <= MAX_SECONDS
        ):
            raise InvalidSchedule(
                f"{what}: interval must be a finite number of seconds, at most "
                f"{MAX_SECONDS:.0f} (1000 years), got {seconds!r} seconds"
            )
    elif kind == "clocked":
        at = spec.get("at")
        try:
            instant = dt.datetime.fromisoformat(at) if isinstance(at, str) else None
        except ValueError:
            instant = None  # make_spec names the problem
        if instant is not None and instant.utcoffset() is not None and instant >= DUE_LIMIT:
            raise InvalidSchedule(
                f"{what}: clocked time {at} is not before {DUE_LIMIT.isoformat()}, "
                "the last due time the store can hold"
            )


# -- periodic schedules: store rows and the public ScheduleInfo ----------------

#: Job statuses in which an occurrence is still in flight: the overlap policy
#: ``skip`` adds no new occurrence while one of these exists.
UNFINISHED_STATUSES = frozenset(
    {JobStatus.PENDING, JobStatus.DISPATCHED, JobStatus.RUNNING, JobStatus.RETRYING}
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NewSchedule:
    """A validated schedule ready to be written: a ``schedules`` row without its state.

    ``body`` is the task's protocol-2 body, serialized once when the schedule
    is added or synced; every occurrence copies it. ``options`` holds the
    message options and ``expires`` as JSON. ``next_nominal_at`` is the first
    instant the planner considers (``None``: the schedule never fires).
    ``misfire``, ``catchup_window`` and ``max_catchup`` are ``None`` when the
    project default applies.
    """

    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    argsrepr: str
    kwargsrepr: str
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    timezone: str = "UTC"
    misfire: str | None = None
    overlap: str = "allow"
    catchup_window: float | None = None
    max_catchup: int | None = None
    relative: bool = False
    enabled: bool = True
    source: str = "dynamic"
    next_nominal_at: dt.datetime | None = None

    def __post_init__(self) -> None:
        check_aware(self, "next_nominal_at")
        if not self.name:
            raise ValueError("schedule name must not be empty")
        if self.source not in ("static", "dynamic"):
            raise ValueError(f"schedule source must be 'static' or 'dynamic', got {self.source!r}")
        # The schedules table's CHECK constraints refuse anything else; the
        # memory store must refuse it as well, and before any write.
        if self.misfire is not None and self.misfire not in set(MisfirePolicy):
            raise ValueError(
                f"schedule misfire policy {self.misfire!r} is not one of skip, once, all"
            )
        if self.overlap not in set(OverlapPolicy):
            raise ValueError(f"schedule overlap policy {self.overlap!r} is not one of allow, skip")

    def timing(self) -> tuple[Any, ...]:
        """The fields that decide *when* it fires; a change restarts it from now."""
        return (self.kind, dict(self.spec), self.timezone, self.relative)

    def definition(self) -> tuple[Any, ...]:
        """Everything a user defines (compared by the static sync)."""
        return (
            *self.timing(),
            self.task,
            self.body,
            self.content_type,
            self.content_encoding,
            self.argsrepr,
            self.kwargsrepr,
            dict(self.options),
            self.misfire,
            self.overlap,
            self.catchup_window,
            self.max_catchup,
            self.enabled,
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StoredSchedule:
    """A ``schedules`` row as stored: the definition plus the planner's state.

    ``last_nominal_at`` is the planner's cursor, the last instant it
    considered (materialized or skipped). When it is ``None``,
    ``next_nominal_at`` is the next instant to consider, exactly; otherwise
    the next one follows the cursor. ``version`` grows with every change a
    user (or the static sync) makes, so a planner that read an older version
    writes nothing for it. ``enabled`` is false for a static schedule that is
    no longer in the code; ``paused`` is the user's switch.
    """

    id: int
    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    body: bytes
    content_type: str
    content_encoding: str
    argsrepr: str
    kwargsrepr: str
    options: Mapping[str, Any]
    timezone: str
    misfire: str | None
    overlap: str
    catchup_window: float | None
    max_catchup: int | None
    relative: bool
    enabled: bool
    source: str
    paused: bool
    version: int
    last_nominal_at: dt.datetime | None
    next_nominal_at: dt.datetime | None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    disabled_at: dt.datetime | None = None
    #: Set when the planner could not plan the schedule (``broken_reason``
    #: says why); the planner skips it until a change replaces it.
    broken_at: dt.datetime | None = None
    broken_reason: str | None = None

    def __post_init__(self) -> None:
        check_aware(
            self,
            "last_nominal_at",
            "next_nominal_at",
            "created_at",
            "updated_at",
            "disabled_at",
            "broken_at",
        )

    def as_new(self) -> NewSchedule:
        """The definition part of this row."""
        return NewSchedule(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(NewSchedule)}
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleAdvance:
    """One planner step for one schedule, written atomically by ``commit_plans``.

    Applied only if the schedule still has ``version`` and is enabled and not
    paused; then the cursor moves to ``last_nominal_at`` / ``next_nominal_at``
    and the ``occurrences`` are inserted (existing keys skipped). With
    ``skip_if_busy`` (overlap ``skip``) the occurrences are not inserted while
    the schedule has an unfinished one; the cursor moves all the same.
    """

    schedule_id: int
    version: int
    last_nominal_at: dt.datetime | None
    next_nominal_at: dt.datetime | None
    occurrences: Sequence[NewJob] = ()
    skip_if_busy: bool = False

    def __post_init__(self) -> None:
        check_aware(self, "last_nominal_at", "next_nominal_at")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanCommit:
    """What one ``commit_plans`` call wrote.

    ``written`` holds ``(id, due_at, shard)`` of every inserted occurrence
    (for staging); ``stale`` counts schedules whose advance was dropped
    because they changed meanwhile; ``busy`` counts occurrences not written
    because of the overlap policy.
    """

    written: list[tuple[uuid.UUID, dt.datetime, int]] = dataclasses.field(default_factory=list)
    stale: int = 0
    busy: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SyncResult:
    """What a static schedule sync changed.

    ``conflicts`` names static definitions whose name is taken by a dynamic
    schedule (left untouched).
    """

    added: int = 0
    updated: int = 0
    disabled: int = 0
    unchanged: int = 0
    conflicts: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleRuns:
    """A schedule's next pending occurrence and its latest one due so far."""

    next_due_at: dt.datetime | None = None
    last_due_at: dt.datetime | None = None
    last_status: JobStatus | None = None

    def __post_init__(self) -> None:
        check_aware(self, "next_due_at", "last_due_at")
        if self.last_status is not None:
            object.__setattr__(self, "last_status", JobStatus(self.last_status))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleInfo:
    """A periodic schedule as users see it (``Client.schedules.get`` / ``list``).

    ``next_run_at`` is the due time of its next pending occurrence, or the
    next instant the planner will materialize; ``None`` when it is paused,
    disabled, broken or will never fire again. ``last_run_at`` /
    ``last_status`` are the latest occurrence due so far and its job status.
    ``broken_at`` / ``broken_reason``: when and why the planner set it aside
    (until it is updated or resumed). ``undecodable``: why its stored
    arguments cannot be read here (a serializer the app's ``accept_content``
    does not list); ``args`` and ``kwargs`` are then empty, ``broken_reason``
    says the same and it counts as broken.
    """

    name: str
    task: str
    kind: str
    spec: Mapping[str, Any]
    timezone: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    misfire: str | None = None
    overlap: str = "allow"
    catchup_window: float | None = None
    max_catchup: int | None = None
    relative: bool = False
    source: str = "dynamic"
    enabled: bool = True
    paused: bool = False
    next_run_at: dt.datetime | None = None
    last_run_at: dt.datetime | None = None
    last_status: JobStatus | None = None
    created_at: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    disabled_at: dt.datetime | None = None
    broken_at: dt.datetime | None = None
    broken_reason: str | None = None
    undecodable: str | None = None

    def __post_init__(self) -> None:
        check_aware(
            self,
            "next_run_at",
            "last_run_at",
            "created_at",
            "updated_at",
            "disabled_at",
            "broken_at",
        )
        if self.last_status is not None:
            object.__setattr__(self, "last_status", JobStatus(self.last_status))

    @property
    def state(self) -> str:
        """``disabled`` (gone from the code), ``paused``, ``broken`` (the
        planner could not plan it: ``broken_reason``), ``finished`` (never
        fires again) or ``active``."""
        if not self.enabled:
            return "disabled"
        if self.undecodable is not None:
            return "broken"  # resuming would not mend it: it says so however paused
        if self.paused:
            return "paused"
        if self.broken_at is not None:
            return "broken"
        if self.next_run_at is None:
            return "finished"
        return "active"
