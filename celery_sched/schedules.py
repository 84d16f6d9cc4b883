"""Periodic schedules: Celery beat entries in, nominal UTC instants out. No I/O.

The planner (``celery_sched.planner``) turns each periodic schedule into one
job row per occurrence, keyed :func:`occurrence_key`. Everything it needs to
know about *when* lives here, as pure functions of a
:class:`~celery_sched.models.ScheduleSpec` and instants handed in by the
caller (the store's clock), so every rule below is unit-tested without
services:

- **Sources.** :func:`make_spec` accepts every schedule beat knows
  (:class:`celery.schedules.crontab`, :class:`~celery.schedules.schedule`,
  ``timedelta``, seconds, :class:`~celery.schedules.solar`), a cron string
  and :class:`clocked` one-offs, and checks everything before anything could
  be written. :func:`specs_from_app` reads ``beat_schedule`` (including
  ``add_periodic_task`` entries) and decorator-declared tasks.
- **Crontab** is evaluated on the wall clock of the schedule's timezone. A
  local time that does not exist (clocks spring forward) fires once, at the
  first valid instant after the gap; a repeated local time (clocks fall back)
  fires once, at its first instant. ``day_of_week`` and ``day_of_month`` are
  ANDed, as Celery's crontab does (classic cron ORs them).
- **Intervals** step in absolute time from the previous *nominal* instant,
  so nothing drifts however late the planner runs.
- **Solar** events come from :mod:`ephem`, set up as Celery's ``solar`` does.
- **Misfire** policies decide what happens to occurrences missed while no
  planner ran (:func:`plan`).
"""

from __future__ import annotations

import bisect
import calendar
import collections
import dataclasses
import datetime as dt
import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from celery.schedules import BaseSchedule, crontab, schedstate, schedule, solar

from celery_sched.errors import InvalidJob, InvalidSchedule, UnknownTimezone
from celery_sched.models import MisfirePolicy, OverlapPolicy, ScheduleSpec
from celery_sched.settings import Settings
from celery_sched.timeutil import EPOCH, UTC, ensure_utc, get_zone, resolve_local
from celery_sched.validation import MAX_KEY_LENGTH, JobBuilder

if TYPE_CHECKING:
    from celery import Celery

__all__ = [
    "CRON_FIELDS",
    "ENTRY_KEYS",
    "Plan",
    "clocked",
    "first_after",
    "make_spec",
    "next_after",
    "occurrence_key",
    "plan",
    "schedule_from_spec",
    "spec_from_entry",
    "specs_from_app",
]

#: The keys of a crontab spec, in Celery's constructor order.
CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")

#: Keys a ``beat_schedule`` entry may have: beat's own, then celery_sched's.
ENTRY_KEYS = frozenset(
    {"task", "schedule", "args", "kwargs", "options", "relative"}
    | {"misfire", "overlap", "catchup_window", "max_catchup", "timezone"}
)

_US = dt.timedelta(microseconds=1)
_SECOND = dt.timedelta(seconds=1)
_MINUTE = dt.timedelta(minutes=1)
_HOUR = dt.timedelta(hours=1)
_DAY = dt.timedelta(days=1)
_EPOCH_NAIVE = EPOCH.replace(tzinfo=None)

# "<name>@2026-03-08T07:00:00.123456Z" is at most 28 characters past the name.
_KEY_SUFFIX = 28
MAX_NAME_LENGTH = MAX_KEY_LENGTH - _KEY_SUFFIX

# A (month, day, weekday) combination that occurs at all occurs within any
# 400 years: the Gregorian calendar repeats exactly every 400 years.
_CRON_YEARS = 400

_CRON_MACROS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

# -- keys -------------------------------------------------------------------------


def occurrence_key(name: str, nominal: dt.datetime) -> str:
    """The job key of one occurrence: ``"<name>@<nominal UTC, ISO 8601>Z"``.

    Two planners computing the same occurrence build the same key, which the
    store's unique index turns into one row. Microseconds appear only when
    non-zero: ``occurrence_key("report", t) == "report@2026-03-08T07:00:00Z"``.
    """
    if nominal.tzinfo is not UTC:
        nominal = ensure_utc(nominal, name="nominal")
    return f"{name}@{nominal.replace(tzinfo=None).isoformat()}Z"


# -- clocked: a one-off usable in beat_schedule too --------------------------------


class clocked(BaseSchedule):  # noqa: N801  (named like Celery's schedule classes)
    """A one-off schedule: fires once, at ``at``.

    ``at`` is an aware datetime, a naive one (read as wall-clock time in the
    schedule's timezone, which defaults to the app's, as Celery reads a naive
    eta), or an ISO 8601 string. A naive time that is ambiguous or does not
    exist there raises :class:`~celery_sched.errors.AmbiguousTime` or
    :class:`~celery_sched.errors.NonExistentTime` when it is resolved.

    Stock beat can run it too: it is due once ``at`` has passed, unless the
    entry last ran at or after ``at`` (beat records the start time as the
    first "last run", so a one-off whose time passed before beat started does
    not fire, like ``misfire="skip"``).
    """

    def __init__(
        self,
        at: dt.datetime | str,
        nowfun: Any = None,
        app: Any = None,
    ) -> None:
        if isinstance(at, str):
            try:
                at = dt.datetime.fromisoformat(at)
            except ValueError as exc:
                raise InvalidSchedule(f"clocked time is not ISO 8601: {at!r}") from exc
        if not isinstance(at, dt.datetime):
            raise InvalidSchedule(f"clocked time must be a datetime, got {type(at).__name__}")
        if at.tzinfo is not None and at.utcoffset() is not None:
            at = at.astimezone(UTC)
        else:
            at = at.replace(tzinfo=None)
        self.at = at
        super().__init__(nowfun=nowfun, app=app)

    def at_utc(self, zone: dt.tzinfo | None = None) -> dt.datetime:
        """``at`` as an aware UTC instant; a naive ``at`` is read in ``zone``
        (default: the app's timezone). Raises AmbiguousTime / NonExistentTime."""
        if self.at.tzinfo is not None:
            return self.at
        app_zone: dt.tzinfo = self.tz  # type: ignore[assignment]  # stubs say str
        return resolve_local(self.at, app_zone if zone is None else zone)

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        now: dt.datetime = self.maybe_make_aware(self.now())
        return self.at_utc() - now

    def is_due(self, last_run_at: dt.datetime) -> schedstate:
        """Due once ``at`` has passed and the entry has not run since ``at``."""
        at = self.at_utc()
        last: dt.datetime = self.maybe_make_aware(last_run_at)
        now: dt.datetime = self.maybe_make_aware(self.now())
        if last >= at:
            return schedstate(is_due=False, next=3600.0)  # done; nothing to wait for
        if now >= at:
            return schedstate(is_due=True, next=3600.0)
        return schedstate(is_due=False, next=(at - now).total_seconds())

    def __repr__(self) -> str:
        return f"<clocked: {self.at.isoformat()}>"

    def __reduce__(self) -> tuple[type[clocked], tuple[dt.datetime, Any]]:
        return self.__class__, (self.at, getattr(self, "nowfun", None))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, clocked):
            return self.at == other.at
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.at)


# -- building specs ------------------------------------------------------------------


def make_spec(
    name: str,
    task: str,
    schedule: object,
    *,
    app: Celery,
    args: Any = (),
    kwargs: Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    timezone: str | dt.tzinfo | None = None,
    misfire: str | MisfirePolicy | None = None,
    overlap: str | OverlapPolicy | None = None,
    catchup_window: float | None = None,
    max_catchup: int | None = None,
    relative: bool = False,
    source: str = "dynamic",
    enabled: bool = True,
) -> ScheduleSpec:
    """Validate one periodic schedule and return its :class:`ScheduleSpec`.

    ``schedule`` is a :class:`celery.schedules.crontab`, a
    :class:`celery.schedules.schedule`, a ``timedelta``, a number of seconds,
    a :class:`celery.schedules.solar`, a :class:`clocked`, or a five-field
    cron string (``"*/5 * * * *"``: minute hour day-of-month month
    day-of-week, or a macro such as ``"@daily"``).

    The timezone is, in order: ``timezone``; the crontab's own (a crontab
    whose ``tz`` was set, like django-celery-beat's); the app's
    (``app.conf.timezone``, else UTC). It is where crontabs are evaluated,
    where a naive clocked time is read and where ``relative`` intervals
    align. ``relative`` applies to intervals, as beat's entry option does (a
    ``schedule`` object's own ``relative`` counts too).

    Raises :class:`~celery_sched.errors.InvalidSchedule` naming the problem
    (invalid crontab field, non-positive interval, unknown policy, unknown or
    invalid option, arguments the task serializer cannot encode, unsupported
    schedule type), :class:`~celery_sched.errors.UnknownTimezone`, or, for a
    naive clocked time, :class:`~celery_sched.errors.AmbiguousTime` /
    :class:`~celery_sched.errors.NonExistentTime`. Nothing is written here;
    a returned spec is one the planner can evaluate.
    """
    return _SpecBuilder(app).build(
        name,
        task,
        schedule,
        args=args,
        kwargs=kwargs,
        options=options,
        timezone=timezone,
        misfire=misfire,
        overlap=overlap,
        catchup_window=catchup_window,
        max_catchup=max_catchup,
        relative=relative,
        source=source,
        enabled=enabled,
    )


def spec_from_entry(name: str, entry: Mapping[str, Any], *, app: Celery) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of one ``app.conf.beat_schedule`` entry.

    The entry has beat's keys (``task``, ``schedule``, ``args``, ``kwargs``,
    ``options``, ``relative``) and optionally celery_sched's (``misfire``,
    ``overlap``, ``catchup_window``, ``max_catchup``, ``timezone``); any other
    key raises :class:`~celery_sched.errors.InvalidSchedule`, as does a
    missing ``task`` or ``schedule``. The spec's source is ``"static"``.
    """
    return _SpecBuilder(app).from_entry(name, entry)


def specs_from_app(app: Celery) -> list[ScheduleSpec]:
    """Every static periodic schedule of ``app``: ``beat_schedule`` entries
    in their order, then decorator-declared tasks sorted by task name.

    Loads the app the way ``celery beat`` does first (imports the modules of
    the ``imports``/``include`` settings, finalizes the app, reads the
    configuration), so entries added with ``app.add_periodic_task`` from
    ``on_after_configure`` / ``on_after_finalize`` handlers are included.

    A decorator-declared task is a registered task whose
    ``periodic_schedule`` attribute is not None; its other attributes
    (``schedule_name`` (default: the task name), ``schedule_args``,
    ``schedule_kwargs``, ``schedule_options``, ``schedule_timezone``,
    ``misfire``, ``overlap``, ``catchup_window``, ``max_catchup``,
    ``schedule_relative``) fill the spec. Every spec's source is ``"static"``.

    Raises :class:`~celery_sched.errors.InvalidSchedule` for the first
    invalid entry (naming it) and when two schedules share a name; then no
    spec is returned at all.
    """
    app.loader.import_default_modules()
    app.finalize()
    builder = _SpecBuilder(app)
    specs: list[ScheduleSpec] = []
    origin: dict[str, str] = {}

    def add(spec: ScheduleSpec, where: str) -> None:
        if spec.name in origin:
            raise InvalidSchedule(
                f"two periodic schedules are named {spec.name!r}: {origin[spec.name]} and "
                f"{where}; give one of them another name"
            )
        origin[spec.name] = where
        specs.append(spec)

    for name, entry in (app.conf.beat_schedule or {}).items():
        add(builder.from_entry(name, entry), f"beat_schedule entry {name!r}")
    tasks = app.tasks
    for task_name in sorted(tasks):
        task = tasks[task_name]
        if getattr(task, "periodic_schedule", None) is not None:
            add(builder.from_task(task_name, task), f"task {task_name!r} (decorator)")
    return specs


def schedule_from_spec(spec: ScheduleSpec, *, app: Celery) -> object:
    """The Celery schedule object a spec stands for (for display and for
    round trips): a ``crontab`` (whose ``tz`` is the spec's timezone), a
    ``schedule`` (with the spec's ``relative``), a ``solar`` or a
    :class:`clocked` with an aware UTC time. Raises InvalidSchedule for a
    definition that does not evaluate."""
    _compiled(spec)
    definition = spec.spec
    if spec.kind == "crontab":
        # celery-types lacks most crontab attributes; `Any` from here on.
        cron: Any = crontab(**{field: str(definition[field]) for field in CRON_FIELDS}, app=app)
        cron.tz = get_zone(spec.timezone)
        return cron
    if spec.kind == "interval":
        every = dt.timedelta(seconds=float(definition["seconds"]))
        return schedule(every, relative=spec.relative, app=app)
    if spec.kind == "solar":
        return solar(definition["event"], definition["lat"], definition["lon"], app=app)
    return clocked(_parse_utc(str(definition["at"])), app=app)


# -- evaluating specs ----------------------------------------------------------------


def first_after(spec: ScheduleSpec, now: dt.datetime) -> dt.datetime | None:
    """The first nominal instant strictly after ``now`` of a schedule with no
    history, or None if it never fires after ``now``.

    Intervals: ``now + every``; with ``relative`` the first occurrence is
    aligned as beat aligns it: the last boundary of the interval's
    resolution (day, hour, minute, second on the schedule's wall clock) at
    or before ``now + every``. Other kinds: :func:`next_after` ``(now)``.
    """
    compiled = _compiled(spec)
    return compiled.next_after(compiled.anchor(_utc(now, "now")))


def next_after(spec: ScheduleSpec, after: dt.datetime) -> dt.datetime | None:
    """The next nominal instant strictly after ``after`` (aware UTC), or None
    if the schedule never fires again.

    Intervals: ``after + every`` (``after`` is the previous nominal instant,
    so nothing drifts). Crontab: the first matching wall-clock minute in the
    schedule's timezone whose instant is after ``after``, with the DST rules
    of this module. Solar: the next event. Clocked: ``at`` if it is after
    ``after``. Raises InvalidSchedule if the definition does not evaluate.
    """
    if spec.kind == "interval":
        # The planner's hot path: one dict lookup and one addition.
        seconds = spec.spec.get("seconds")
        every = _INTERVALS.get(seconds) if type(seconds) is float or type(seconds) is int else None
        if every is not None:
            if after.tzinfo is not UTC:
                after = _utc(after, "after")
            try:
                return after + every
            except OverflowError:
                return None
    return _compiled(spec).next_after(_utc(after, "after"))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """What :func:`plan` decided for one schedule."""

    #: Nominal UTC instants to materialize now, ascending, no duplicates.
    occurrences: list[dt.datetime]
    #: Missed occurrences dropped by the misfire policy.
    skipped: int
    #: The new ``last_nominal_at``: the last instant considered (materialized
    #: or skipped). For a brand-new schedule with nothing to materialize yet,
    #: the instant its first occurrence was computed from, so that the next
    #: call continues from there (``next_after(cursor) == next_nominal``).
    #: None only when the schedule never fires.
    cursor: dt.datetime | None
    #: ``next_after(cursor)``: the next occurrence not yet materialized (None
    #: when the schedule is exhausted).
    next_nominal: dt.datetime | None


def plan(
    spec: ScheduleSpec,
    *,
    last_nominal: dt.datetime | None,
    now: dt.datetime,
    horizon: dt.datetime,
    default_misfire: MisfirePolicy | str,
    catchup_window: float,
    max_catchup: int,
    grace: float,
    limit: int = 1000,
) -> Plan:
    """Decide which occurrences of ``spec`` to materialize now.

    Occurrences come after ``last_nominal`` (the previous plan's cursor) and
    are at or before ``horizon``. One is *missed* when its nominal instant is
    before ``now - grace``. Missed ones follow the misfire policy
    (``spec.misfire``, else ``default_misfire``):

    - ``skip``: none runs;
    - ``once``: only the latest missed one runs;
    - ``all``: each missed one whose nominal instant is within
      ``catchup_window`` seconds of ``now`` runs, at most ``max_catchup`` of
      them, the latest kept (``spec.catchup_window`` / ``spec.max_catchup``
      override the arguments, which are the project defaults).

    Every future occurrence (``now - grace`` up to ``horizon``) is
    materialized, at most ``limit`` in one call; the cursor stops at the last
    one returned so the next call continues there. ``last_nominal=None``
    means a brand-new schedule: it starts at :func:`first_after` ``(now)``
    and nothing is missed. ``spec.enabled`` is not consulted: whether a
    schedule is planned at all is the caller's decision.

    Guarantees: occurrences are ascending and unique, all after
    ``last_nominal``; at most ``max_catchup`` missed ones plus ``limit``
    future ones; ``skipped`` counts exactly the missed ones not returned.
    A long outage costs little: missed occurrences are counted and the kept
    ones found without visiting each (intervals by arithmetic, crontabs a
    whole day at a time).
    """
    if type(limit) is not int or limit < 1:
        raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
    if not grace >= 0:
        raise ValueError(f"grace must be >= 0 seconds, got {grace!r}")
    now = _utc(now, "now")
    horizon = _utc(horizon, "horizon")
    compiled = _compiled(spec)
    policy = spec.misfire or MisfirePolicy(default_misfire)
    window = catchup_window if spec.catchup_window is None else spec.catchup_window
    most = max_catchup if spec.max_catchup is None else spec.max_catchup
    cutoff = now - dt.timedelta(seconds=grace)

    occurrences: list[dt.datetime] = []
    skipped = 0
    cursor: dt.datetime | None
    if last_nominal is None:
        cursor = compiled.anchor(now)
        upcoming = compiled.next_after(cursor)
        if upcoming is None:
            cursor = None
    else:
        cursor = _utc(last_nominal, "last_nominal")
        upcoming = compiled.next_after(cursor)
        if upcoming is not None and upcoming < cutoff:
            if policy is MisfirePolicy.ONCE:
                kept = compiled.latest(cursor, None, cutoff, 1)
            elif policy is MisfirePolicy.ALL and most > 0 and window >= 0:
                try:
                    floor: dt.datetime | None = now - dt.timedelta(seconds=window)
                except OverflowError:  # an unbounded window
                    floor = None
                kept = compiled.latest(cursor, floor, cutoff, most)
            else:
                kept = []
            latest = kept[-1] if kept else compiled.latest(cursor, None, cutoff, 1)[-1]
            skipped = compiled.count(cursor, cutoff) - len(kept)
            occurrences.extend(kept)
            cursor = latest
            upcoming = compiled.next_after(latest)

    future = 0
    while upcoming is not None and upcoming <= horizon and future < limit:
        occurrences.append(upcoming)
        cursor = upcoming
        future += 1
        upcoming = compiled.next_after(upcoming)
    return Plan(occurrences=occurrences, skipped=skipped, cursor=cursor, next_nominal=upcoming)


# -- definitions: celery schedule objects <-> JSON specs ---------------------------------


class _SpecBuilder:
    """Builds specs against one app; resolves the app's timezone and the job
    validator once, for apps with many entries."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.app_zone = _app_zone(app)
        self._jobs: JobBuilder | None = None

    def build(
        self,
        name: Any,
        task: Any,
        schedule: object,
        *,
        args: Any,
        kwargs: Any,
        options: Any,
        timezone: Any,
        misfire: Any,
        overlap: Any,
        catchup_window: Any,
        max_catchup: Any,
        relative: Any,
        source: str,
        enabled: bool,
    ) -> ScheduleSpec:
        _check_name(name)
        what = f"schedule {name!r}"
        if type(task) is not str or not task:
            raise InvalidSchedule(f"{what}: task must be a non-empty string, got {task!r}")
        if type(relative) is not bool:
            raise InvalidSchedule(f"{what}: relative must be a bool, got {relative!r}")
        zone_name = None if timezone is None else _zone_name(timezone)
        kind, definition, zone_name, relative = _definition(
            what, schedule, default_zone=self.app_zone, zone_name=zone_name, relative=relative
        )
        if args is None:
            args = ()
        if not isinstance(args, (list, tuple)):
            raise InvalidSchedule(
                f"{what}: args must be a list or tuple, got {type(args).__name__}"
            )
        for label, value in (("kwargs", kwargs), ("options", options)):
            if value is not None and not isinstance(value, Mapping):
                raise InvalidSchedule(
                    f"{what}: {label} must be a mapping, got {type(value).__name__}"
                )
        args, kwargs, options = tuple(args), dict(kwargs or {}), dict(options or {})
        if args or kwargs or options:
            self._check_payload(what, name, task, args, kwargs, options)
        spec = ScheduleSpec(
            name=name,
            task=task,
            kind=kind,
            spec=definition,
            timezone=zone_name,
            args=args,
            kwargs=kwargs,
            options=options,
            misfire=_policy(what, "misfire", MisfirePolicy, misfire),
            overlap=_policy(what, "overlap", OverlapPolicy, overlap) or OverlapPolicy.ALLOW,
            catchup_window=catchup_window,
            max_catchup=max_catchup,
            relative=relative,
            enabled=enabled,
            source=source,
        )
        _compiled(spec)  # the definition evaluates, or InvalidSchedule
        return spec

    def from_entry(self, name: Any, entry: Any) -> ScheduleSpec:
        what = f"beat_schedule entry {name!r}"
        if not isinstance(entry, Mapping):
            raise InvalidSchedule(f"{what} must be a mapping, got {type(entry).__name__}")
        unknown = sorted(str(key) for key in entry if key not in ENTRY_KEYS)
        if unknown:
            raise InvalidSchedule(
                f"{what}: unknown key(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(sorted(ENTRY_KEYS))}"
            )
        for required in ("task", "schedule"):
            if entry.get(required) is None:
                raise InvalidSchedule(f"{what} has no {required!r}")
        relative = entry.get("relative")
        return self.build(
            name,
            entry["task"],
            entry["schedule"],
            args=entry.get("args"),
            kwargs=entry.get("kwargs"),
            options=entry.get("options"),
            timezone=entry.get("timezone"),
            misfire=entry.get("misfire"),
            overlap=entry.get("overlap"),
            catchup_window=entry.get("catchup_window"),
            max_catchup=entry.get("max_catchup"),
            relative=False if relative is None else relative,
            source="static",
            enabled=True,
        )

    def from_task(self, task_name: str, task: Any) -> ScheduleSpec:
        def attribute(name: str) -> Any:
            return getattr(task, name, None)

        return self.build(
            attribute("schedule_name") or task_name,
            task_name,
            attribute("periodic_schedule"),
            args=attribute("schedule_args"),
            kwargs=attribute("schedule_kwargs"),
            options=attribute("schedule_options"),
            timezone=attribute("schedule_timezone"),
            misfire=attribute("misfire"),
            overlap=attribute("overlap"),
            catchup_window=attribute("catchup_window"),
            max_catchup=attribute("max_catchup"),
            relative=bool(attribute("schedule_relative")),
            source="static",
            enabled=True,
        )

    def _check_payload(
        self,
        what: str,
        name: str,
        task: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        options: dict[str, Any],
    ) -> None:
        """Refuse arguments and options that could not become a job: the
        checks ``Client.schedule`` runs (serializer, size, option names and
        values), on a sample occurrence."""
        expires = options.get("expires")
        if expires is not None and (type(expires) is bool or not isinstance(expires, (int, float))):
            raise InvalidSchedule(
                f"{what}: option expires must be a number of seconds after each occurrence, "
                f"got {expires!r}"
            )
        if self._jobs is None:
            self._jobs = JobBuilder(self.app, Settings.from_app(self.app))
        sample = dt.datetime(2000, 1, 1, tzinfo=UTC)
        try:
            self._jobs.build(
                task,
                args,
                kwargs,
                eta=sample,
                key=occurrence_key(name, sample),
                check_task=False,
                now=lambda: sample,
                options=options,
            )
        except UnknownTimezone:
            raise
        except InvalidJob as exc:
            raise InvalidSchedule(f"{what}: {exc}") from exc


def _definition(
    what: str, value: object, *, default_zone: str, zone_name: str | None, relative: bool
) -> tuple[str, dict[str, Any], str, bool]:
    """(kind, JSON spec, timezone name, relative) of a user's schedule value."""
    if isinstance(value, str):
        value = _cron_from_string(what, value)
    if isinstance(value, crontab):
        cron: Any = value  # celery-types lacks the field attributes
        own = vars(cron).get("tz")  # set explicitly (cached_property), e.g. TzAwareCrontab
        if zone_name is None and own is not None:
            zone_name = _zone_name(own)
        fields = {
            "minute": _cron_text(cron._orig_minute, cron.minute, 0, 60),
            "hour": _cron_text(cron._orig_hour, cron.hour, 0, 24),
            "day_of_week": _cron_text(cron._orig_day_of_week, cron.day_of_week, 0, 7),
            "day_of_month": _cron_text(cron._orig_day_of_month, cron.day_of_month, 1, 31),
            "month_of_year": _cron_text(cron._orig_month_of_year, cron.month_of_year, 1, 12),
        }
        return "crontab", fields, zone_name or default_zone, False
    if isinstance(value, schedule):
        return (
            "interval",
            _interval(what, getattr(value, "run_every", None)),
            zone_name or default_zone,
            (relative or bool(value.relative)),
        )
    if isinstance(value, dt.timedelta) or (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    ):
        return "interval", _interval(what, value), zone_name or default_zone, relative
    if isinstance(value, solar):
        definition = {"event": value.event, "lat": float(value.lat), "lon": float(value.lon)}
        return "solar", definition, zone_name or default_zone, False
    if isinstance(value, clocked):
        zone_name = zone_name or default_zone
        at = value.at_utc(get_zone(zone_name))  # AmbiguousTime / NonExistentTime
        return "clocked", {"at": _format_utc(at)}, zone_name, False
    raise InvalidSchedule(
        f"{what}: unsupported schedule type {type(value).__name__}; use a crontab, a schedule, "
        "a timedelta or number of seconds, a solar, a celery_sched.schedules.clocked, "
        "or a cron string"
    )


def _cron_from_string(what: str, text: str) -> crontab:
    expression = _CRON_MACROS.get(text.strip().lower(), text)
    parts = expression.split()
    if len(parts) != 5:
        raise InvalidSchedule(
            f"{what}: cron string {text!r} must have 5 fields "
            "(minute hour day-of-month month day-of-week)"
        )
    minute, hour, day_of_month, month_of_year, day_of_week = parts
    fields = {
        "minute": minute,
        "hour": hour,
        "day_of_week": day_of_week,
        "day_of_month": day_of_month,
        "month_of_year": month_of_year,
    }
    return _parse_crontab(what, fields)


def _parse_crontab(what: str, fields: Mapping[str, str]) -> crontab:
    """Celery's crontab for ``fields``; InvalidSchedule names the bad field."""
    try:
        return crontab(**fields)
    except Exception as exc:  # Celery raises ValueError, TypeError or ParseException
        for field in CRON_FIELDS:
            try:
                crontab(**{field: fields[field]})
            except Exception as field_exc:
                raise InvalidSchedule(
                    f"{what}: invalid crontab field {field}={fields[field]!r}: {field_exc}"
                ) from exc
        raise InvalidSchedule(f"{what}: crontab never fires: {exc}") from exc


def _cron_text(original: Any, expanded: set[int], low: int, size: int) -> str:
    """The cron string of a crontab field: the user's own text when given as
    text, else the expanded values (``*`` when every value is in)."""
    if isinstance(original, str):
        return original.strip()
    if set(expanded) == set(range(low, low + size)):
        return "*"
    return ",".join(str(value) for value in sorted(expanded))


def _interval(what: str, every: Any) -> dict[str, Any]:
    seconds = every.total_seconds() if isinstance(every, dt.timedelta) else every
    if type(seconds) is bool or not isinstance(seconds, (int, float)):
        raise InvalidSchedule(f"{what}: interval must be a number of seconds, got {every!r}")
    seconds = float(seconds)
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidSchedule(f"{what}: interval must be positive, got {seconds!r} seconds")
    if seconds < 1e-6:
        raise InvalidSchedule(f"{what}: interval must be at least a microsecond, got {seconds!r}")
    return {"seconds": seconds}


def _check_name(name: Any) -> None:
    if type(name) is not str or not name.strip():
        raise InvalidSchedule(f"schedule name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidSchedule(
            f"schedule name must be at most {MAX_NAME_LENGTH} characters (it prefixes job "
            f"keys), got {len(name)}: {name[:40]!r}..."
        )
    if "\x00" in name:
        raise InvalidSchedule(f"schedule name must not contain NUL characters: {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidSchedule(f"schedule name is not valid Unicode text: {name!r}") from exc


def _policy(what: str, label: str, kind: Any, value: Any) -> Any:
    if value is None:
        return None
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise InvalidSchedule(
            f"{what}: unknown {label} policy {value!r}; expected one of {choices}"
        ) from None


def _zone_name(zone: Any) -> str:
    """The IANA name of a timezone given as a name or a tzinfo."""
    if isinstance(zone, str):
        get_zone(zone)  # UnknownTimezone
        return "UTC" if zone.upper() == "UTC" else zone
    if zone is UTC or zone == dt.UTC:
        return "UTC"
    for attribute in ("key", "zone"):  # zoneinfo, pytz
        name = getattr(zone, attribute, None)
        if isinstance(name, str):
            return _zone_name(name)
    raise UnknownTimezone(f"timezone {zone!r} has no IANA name; give it by name")


def _app_zone(app: Any) -> str:
    configured = app.conf.timezone
    return "UTC" if configured is None else _zone_name(configured)


def _format_utc(value: dt.datetime) -> str:
    return value.astimezone(UTC).replace(tzinfo=None).isoformat() + "Z"


def _parse_utc(text: str) -> dt.datetime:
    value = dt.datetime.fromisoformat(text)
    if value.tzinfo is None:
        raise ValueError("a clocked spec's time must carry its offset (…Z)")
    return value.astimezone(UTC)


def _utc(value: dt.datetime, name: str) -> dt.datetime:
    if type(value) is not dt.datetime and not isinstance(value, dt.datetime):
        raise TypeError(f"{name} must be a datetime, got {type(value).__name__}")
    return value if value.tzinfo is UTC else ensure_utc(value, name=name)


# -- wall clock -------------------------------------------------------------------


def _wall_to_utc(wall: dt.datetime, zone: dt.tzinfo) -> dt.datetime:
    """The instant a naive wall-clock time in ``zone`` stands for.

    A repeated time (clocks fall back) is its first instant; a time that does
    not exist (clocks spring forward) is the first valid instant after the
    gap, i.e. the transition itself. The map never decreases as ``wall``
    grows, which is what lets the crontab search walk wall-clock time.
    """
    before = wall.replace(tzinfo=zone).utcoffset()
    after = wall.replace(tzinfo=zone, fold=1).utcoffset()
    assert before is not None and after is not None
    if before >= after:  # unambiguous, or repeated (fold=0 is the first pass)
        return (wall - before).replace(tzinfo=UTC)
    # In a gap fold=0 reads the time with the offset before the transition
    # and fold=1 with the one after; the transition lies between the two
    # readings. Transitions fall on whole seconds: bisect for it.
    low = (wall - after - _EPOCH_NAIVE) // _SECOND  # offset `before` here
    high = (wall - before - _EPOCH_NAIVE) // _SECOND  # offset `after` here
    while high - low > 1:
        middle = (low + high) // 2
        if dt.datetime.fromtimestamp(middle, zone).utcoffset() == after:
            high = middle
        else:
            low = middle
    return EPOCH + dt.timedelta(seconds=high)


def _steady_offset(day: dt.datetime, zone: dt.tzinfo) -> dt.timedelta | None:
    """The UTC offset of the whole local day starting at midnight ``day``
    (naive), or None if the offset changes during it."""
    end = day + _DAY
    offset = zone.utcoffset(day)
    if (
        offset is None
        or zone.utcoffset(day.replace(fold=1)) != offset
        or zone.utcoffset(end) != offset
        or zone.utcoffset(end.replace(fold=1)) != offset
    ):
        return None
    return offset


_UNKNOWN = object()


class _WallClock:
    """:func:`_wall_to_utc` for one zone, fast on the days (nearly all) whose
    offset does not change: those are remembered by ordinal."""

    def __init__(self, zone: dt.tzinfo) -> None:
        self.zone = zone
        self._days: dict[int, dt.timedelta | None] = {}

    def day_offset(self, wall: dt.datetime) -> dt.timedelta | None:
        """The offset of ``wall``'s whole local day, None if it changes."""
        ordinal = wall.toordinal()
        offset = self._days.get(ordinal, _UNKNOWN)
        if offset is _UNKNOWN:
            midnight = dt.datetime.fromordinal(ordinal)
            offset = _steady_offset(midnight, self.zone)
            if len(self._days) >= 4096:
                self._days.clear()
            self._days[ordinal] = offset
        return offset  # type: ignore[return-value]

    def instant(self, wall: dt.datetime) -> dt.datetime:
        offset = self.day_offset(wall)
        if offset is None:
            return _wall_to_utc(wall, self.zone)
        return EPOCH + (wall - _EPOCH_NAIVE - offset)


# -- compiled schedules --------------------------------------------------------------


class _Compiled:
    """A spec's definition parsed once; evaluates instants (aware UTC)."""

    #: Width of the first window :meth:`latest` searches, doubled as needed.
    probe = _HOUR

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        raise NotImplementedError

    def anchor(self, now: dt.datetime) -> dt.datetime:
        """The instant whose :meth:`next_after` is the first occurrence of a
        schedule with no history, planned at ``now``."""
        return now

    def count(self, cursor: dt.datetime, cutoff: dt.datetime) -> int:
        """How many occurrences lie strictly between ``cursor`` and ``cutoff``."""
        total = 0
        moment = self.next_after(cursor)
        while moment is not None and moment < cutoff:
            total += 1
            moment = self.next_after(moment)
        return total

    def latest(
        self, cursor: dt.datetime, floor: dt.datetime | None, cutoff: dt.datetime, n: int
    ) -> list[dt.datetime]:
        """The latest ``n`` occurrences after ``cursor``, at or after ``floor``
        (if given) and before ``cutoff``, ascending.

        Searches windows ending at ``cutoff``, growing fourfold, so the work
        depends on how many occurrences are wanted, not on how far back
        ``cursor`` lies.
        """
        if n <= 0:
            return []
        low = cursor if floor is None or floor <= cursor else floor - _US
        width = self.probe
        while True:
            try:
                start = max(low, cutoff - width)
            except OverflowError:
                start = low
            found: collections.deque[dt.datetime] = collections.deque(maxlen=n)
            moment = self.next_after(start)
            while moment is not None and moment < cutoff:
                found.append(moment)
                moment = self.next_after(moment)
            if len(found) == n or start == low:
                return list(found)
            width *= 4


_INTERVALS: dict[Any, dt.timedelta] = {}


class _Interval(_Compiled):
    def __init__(self, seconds: float, relative: bool, zone: dt.tzinfo) -> None:
        self.every = dt.timedelta(seconds=seconds)
        if self.every <= dt.timedelta(0):
            raise InvalidSchedule(f"interval must be positive, got {seconds!r} seconds")
        self.relative = relative
        self.zone = zone
        self.probe = max(_HOUR, self.every)
        if len(_INTERVALS) < 65536:
            _INTERVALS[seconds] = self.every

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        try:
            return after + self.every
        except OverflowError:
            return None

    def anchor(self, now: dt.datetime) -> dt.datetime:
        if not self.relative:
            return now
        return self._aligned_first(now) - self.every

    def _aligned_first(self, now: dt.datetime) -> dt.datetime:
        # As celery.utils.time.remaining(relative=True): the last boundary
        # of the interval's resolution at or before now + every, on the wall
        # clock; day intervals add calendar days.
        every = self.every
        local = now.astimezone(self.zone).replace(tzinfo=None)
        if every >= _DAY:
            wall = (local + every).replace(hour=0, minute=0, second=0, microsecond=0)
        else:
            wall = (now + every).astimezone(self.zone).replace(tzinfo=None)
            if every >= _HOUR:
                wall = wall.replace(minute=0, second=0, microsecond=0)
            elif every >= _MINUTE:
                wall = wall.replace(second=0, microsecond=0)
            else:
                wall = wall.replace(microsecond=0)
        first = _wall_to_utc(wall, self.zone)
        # Rounding can reach back past now only around a DST change.
        return first if first > now else now + every

    def count(self, cursor: dt.datetime, cutoff: dt.datetime) -> int:
        if cutoff <= cursor:
            return 0
        return (cutoff - cursor - _US) // self.every

    def latest(
        self, cursor: dt.datetime, floor: dt.datetime | None, cutoff: dt.datetime, n: int
    ) -> list[dt.datetime]:
        last = self.count(cursor, cutoff)  # steps k = 1..last are before cutoff
        first = max(1, last - n + 1)
        if floor is not None and floor > cursor:
            first = max(first, -((cursor - floor) // self.every))  # ceil((floor-cursor)/every)
        return [cursor + k * self.every for k in range(first, last + 1)]


class _Cron(_Compiled):
    """A crontab on the wall clock of a zone, with Celery's field semantics."""

    probe = 2 * _MINUTE

    def __init__(self, fields: Mapping[str, Any], zone: dt.tzinfo) -> None:
        cron: Any = _parse_crontab("crontab", {field: str(fields[field]) for field in CRON_FIELDS})
        self.minutes = sorted(cron.minute)
        self.hours = sorted(cron.hour)
        self.months = sorted(cron.month_of_year)
        self.month_set = frozenset(self.months)
        self.days = frozenset(cron.day_of_month)
        self.weekdays = frozenset(cron.day_of_week)  # 0 = Sunday
        self.zone = zone
        self.clock = _WallClock(zone)
        self.per_day = len(self.minutes) * len(self.hours)

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        zone = self.zone
        local = after if zone is UTC else after.astimezone(zone)
        try:
            wall = dt.datetime(local.year, local.month, local.day, local.hour, local.minute)
            wall += _MINUTE
            while True:
                found = self._next_wall(wall)
                if found is None:
                    return None
                instant = self.clock.instant(found)
                # Only when `after` lies in the second pass of a repeated hour
                # do wall times after it map to instants before it.
                if instant > after:
                    return instant
                wall = found + _MINUTE
        except OverflowError:  # past year 9999
            return None

    def _next_wall(self, wall: dt.datetime) -> dt.datetime | None:
        """The first matching wall-clock minute at or after ``wall`` (naive),
        skipping whole months, days and hours that cannot match."""
        year, month, day, hour, minute = wall.year, wall.month, wall.day, wall.hour, wall.minute
        months, hours, minutes = self.months, self.hours, self.minutes
        last_year = min(year + _CRON_YEARS, dt.MAXYEAR)
        while year <= last_year:
            if month not in self.month_set:
                index = bisect.bisect_left(months, month)
                if index == len(months):
                    year += 1
                    month = months[0]
                else:
                    month = months[index]
                day, hour, minute = 1, 0, 0
                continue
            found_day = self._next_day(year, month, day)
            if found_day is None:
                month += 1
                if month > 12:
                    year += 1
                    month = 1
                day, hour, minute = 1, 0, 0
                continue
            if found_day != day:
                day, hour, minute = found_day, 0, 0
            index = bisect.bisect_left(hours, hour)
            if index == len(hours):
                day, hour, minute = day + 1, 0, 0
                continue
            if hours[index] != hour:
                hour, minute = hours[index], 0
            index = bisect.bisect_left(minutes, minute)
            if index == len(minutes):
                hour, minute = hour + 1, 0
                continue
            return dt.datetime(year, month, day, hour, minutes[index])
        return None

    def _next_day(self, year: int, month: int, day: int) -> int | None:
        first_weekday, days_in_month = _month_shape(year, month)
        days, weekdays = self.days, self.weekdays
        for candidate in range(day, days_in_month + 1):
            # Celery ANDs day_of_month and day_of_week (cron ORs them).
            if candidate in days and (first_weekday + candidate) % 7 in weekdays:
                return candidate
        return None

    def count(self, cursor: dt.datetime, cutoff: dt.datetime) -> int:
        # A day without an offset change holds every hour x minute pair:
        # count it in one step instead of visiting each occurrence.
        zone, clock, per_day = self.zone, self.clock, self.per_day
        first_hour, first_minute = self.hours[0], self.minutes[0]
        total = 0
        moment = self.next_after(cursor)
        while moment is not None and moment < cutoff:
            local = moment if zone is UTC else moment.astimezone(zone)
            if per_day > 1 and local.hour == first_hour and local.minute == first_minute:
                midnight = dt.datetime(local.year, local.month, local.day)
                if clock.day_offset(midnight) is not None:
                    day_end = clock.instant(midnight + _DAY)
                    if day_end <= cutoff:
                        total += per_day
                        moment = self.next_after(day_end - _US)
                        continue
            total += 1
            moment = self.next_after(moment)
        return total


@functools.lru_cache(maxsize=4096)
def _month_shape(year: int, month: int) -> tuple[int, int]:
    """(weekday of the 1st with Monday = 0, days in the month)."""
    return calendar.monthrange(year, month)


class _Solar(_Compiled):
    """Solar events from ephem, observed as Celery's ``solar`` sets it up."""

    #: Days searched for an event that does not happen every day (polar
    #: night and day); none within a year means it never happens there.
    max_search_days = 366
    probe = 2 * _DAY

    def __init__(self, event: str, lat: float, lon: float) -> None:
        try:
            reference: Any = solar(cast(Any, event), lat, lon)
        except Exception as exc:  # ValueError, or ImproperlyConfigured without ephem
            raise InvalidSchedule(f"invalid solar schedule: {exc}") from exc
        self.ephem: Any = reference.ephem
        self.lat, self.lon = str(lat), str(lon)
        self.horizon = reference.cal.horizon
        self.method = reference.method
        self.use_center = reference.use_center

    def _observer(self) -> Any:
        # A fresh observer per call: ephem observers are mutable, and the
        # planner may evaluate schedules from more than one thread.
        observer = self.ephem.Observer()
        observer.lat, observer.lon = self.lat, self.lon
        observer.elev = 0
        observer.horizon = self.horizon
        observer.pressure = 0
        return observer

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        ephem = self.ephem
        observer = self._observer()
        sun = ephem.Sun()
        find = getattr(observer, self.method)
        extra = {"use_center": True} if self.use_center else {}
        start = ephem.Date(after.replace(tzinfo=None))
        for _ in range(self.max_search_days):
            try:
                event = find(sun, start=start, **extra)
            except ephem.CircumpolarError:
                start = observer.next_antitransit(sun, start=start)
                continue
            # Whole seconds: keys stay short and equal across processes.
            naive: dt.datetime = event.datetime()
            instant = (naive + dt.timedelta(microseconds=500_000)).replace(
                microsecond=0, tzinfo=UTC
            )
            if instant > after:
                return instant
            start = ephem.Date(event + ephem.minute)
        return None


class _Clocked(_Compiled):
    probe = 366 * _DAY

    def __init__(self, at: dt.datetime) -> None:
        self.at = at

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        return self.at if self.at > after else None


def _compiled(spec: ScheduleSpec) -> _Compiled:
    """The evaluator of ``spec`` (cached by definition); InvalidSchedule if
    the definition does not evaluate."""
    definition = spec.spec
    try:
        if spec.kind == "interval":
            key: tuple[Any, ...] = (definition["seconds"],)
            if type(key[0]) is bool:  # the cache would take True for 1
                raise InvalidSchedule(f"interval seconds must be a number, got {key[0]!r}")
        elif spec.kind == "crontab":
            key = (
                definition["minute"],
                definition["hour"],
                definition["day_of_week"],
                definition["day_of_month"],
                definition["month_of_year"],
            )
        elif spec.kind == "solar":
            key = (definition["event"], definition["lat"], definition["lon"])
        else:
            key = (definition["at"],)
        return _compile(spec.kind, key, spec.timezone, spec.relative)
    except KeyError as exc:
        raise InvalidSchedule(
            f"schedule {spec.name!r}: {spec.kind} spec lacks {exc.args[0]!r}: {dict(definition)}"
        ) from None
    except InvalidSchedule as exc:
        raise InvalidSchedule(f"schedule {spec.name!r}: {exc}") from exc
    except TypeError as exc:  # an unhashable value in the definition
        raise InvalidSchedule(f"schedule {spec.name!r}: invalid {spec.kind} spec: {exc}") from exc


@functools.lru_cache(maxsize=16384)
def _compile(kind: str, key: tuple[Any, ...], zone_name: str, relative: bool) -> _Compiled:
    zone = get_zone(zone_name)
    if kind == "interval":
        seconds = key[0]
        if type(seconds) is bool or not isinstance(seconds, (int, float)):
            raise InvalidSchedule(f"interval seconds must be a number, got {seconds!r}")
        if not math.isfinite(seconds) or seconds <= 0:
            raise InvalidSchedule(f"interval must be positive, got {seconds!r} seconds")
        return _Interval(float(seconds), relative, zone)
    if kind == "crontab":
        return _Cron(dict(zip(CRON_FIELDS, key, strict=True)), zone)
    if kind == "solar":
        event, lat, lon = key
        if not isinstance(event, str):
            raise InvalidSchedule(f"solar event must be a string, got {event!r}")
        for label, value in (("lat", lat), ("lon", lon)):
            if type(value) is bool or not isinstance(value, (int, float)):
                raise InvalidSchedule(f"solar {label} must be a number, got {value!r}")
        return _Solar(event, float(lat), float(lon))
    if kind == "clocked":
        try:
            return _Clocked(_parse_utc(str(key[0])))
        except ValueError as exc:
            raise InvalidSchedule(f"clocked time {key[0]!r} is invalid: {exc}") from exc
    raise InvalidSchedule(f"unknown schedule kind {kind!r}")
