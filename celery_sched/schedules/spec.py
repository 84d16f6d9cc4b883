"""The spec of a periodic schedule, built from Celery objects.

:func:`make_spec` accepts every schedule beat knows
(:class:`celery.schedules.crontab`, :class:`~celery.schedules.schedule`,
``timedelta``, seconds, :class:`~celery.schedules.solar`), a cron string and
:class:`~celery_sched.schedules.clocked` one-offs, and checks everything
before anything could be written. Any other object beat could drive (an
``is_due`` method, e.g. a :class:`celery.schedules.BaseSchedule` subclass)
is a *custom* schedule, accepted in the code's schedules only
(:mod:`~celery_sched.schedules.custom`). :func:`specs_from_app` reads
``beat_schedule`` (including ``add_periodic_task`` entries) and
decorator-declared tasks. :class:`SpecBuilder` does the work for all of
them, once per app.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from celery.schedules import crontab, schedule, solar

from celery_sched.errors import CelerySchedError, InvalidJob, InvalidSchedule, UnknownTimezone
from celery_sched.models import MisfirePolicy, OverlapPolicy, ScheduleSpec
from celery_sched.schedules.clocked_time import clocked, format_utc, parse_utc
from celery_sched.schedules.cron import CRON_FIELDS, cron_from_string, cron_text, read_crontab
from celery_sched.schedules.custom import (
    DEFAULT_MAX_INTERVAL,
    CustomDefinition,
    is_custom_schedule,
)
from celery_sched.schedules.evaluate import compile_spec, first_after
from celery_sched.schedules.interval import interval_definition
from celery_sched.schedules.rows import MAX_NAME_LENGTH, occurrence_key
from celery_sched.settings import Settings
from celery_sched.timeutil import UTC, get_zone
from celery_sched.validation import JobBuilder, check_text

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)

#: Keys a ``beat_schedule`` entry may have: beat's own, then celery_sched's.
ENTRY_KEYS = frozenset(
    {"task", "schedule", "args", "kwargs", "options", "relative"}
    | {"misfire", "overlap", "catchup_window", "max_catchup", "timezone"}
)


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
    day-of-week, or a macro such as ``"@daily"``). With ``source="static"``
    it may also be any other object beat could drive (a custom schedule
    class: :mod:`~celery_sched.schedules.custom`); its spec carries the
    object, and is asked once here for its next instant.

    The timezone is, in order: ``timezone``; the crontab's own (a crontab
    whose ``tz`` was set, like django-celery-beat's); the app's
    (``app.conf.timezone``, else UTC). It is where crontabs are evaluated,
    where a naive clocked time is read and where ``relative`` intervals
    align. ``relative`` applies to intervals, as beat's entry option does (a
    ``schedule`` object's own ``relative`` counts too).

    Raises :class:`~celery_sched.errors.InvalidSchedule` naming the problem
    (invalid crontab field, non-positive interval, unknown policy, unknown or
    invalid option, arguments the task serializer cannot encode, unsupported
    schedule type, a custom schedule object outside the code's schedules or
    one that fails when asked), :class:`~celery_sched.errors.UnknownTimezone`, or, for a
    naive clocked time, :class:`~celery_sched.errors.AmbiguousTime` /
    :class:`~celery_sched.errors.NonExistentTime`. Nothing is written here;
    a returned spec is one the planner can evaluate.
    """
    return SpecBuilder(app).build(
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
    return SpecBuilder(app).from_entry(name, entry)


def specs_from_app(app: Celery, *, skip_invalid: bool = False) -> list[ScheduleSpec]:
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

    Raises :class:`~celery_sched.errors.InvalidSchedule` (or
    :class:`~celery_sched.errors.UnknownTimezone`, ...) for the first invalid
    entry (naming it) and when two schedules share a name; then no spec is
    returned at all. With ``skip_invalid`` (beat at start) such an entry is
    logged at ERROR with its name and the reason and left out, and the
    others are returned: one schedule that cannot be handled must not stop
    the rest.
    """
    app.loader.import_default_modules()
    app.finalize()
    builder = SpecBuilder(app)
    specs: list[ScheduleSpec] = []
    origin: dict[str, str] = {}

    def add(build: Callable[[], ScheduleSpec], where: str) -> None:
        try:
            spec = build()
            if spec.name in origin:
                raise InvalidSchedule(
                    f"two periodic schedules are named {spec.name!r}: {origin[spec.name]} and "
                    f"{where}; give one of them another name"
                )
        except CelerySchedError as exc:
            if not skip_invalid:
                raise
            logger.error("periodic schedule of %s left out: %s", where, exc)
            return
        origin[spec.name] = where
        specs.append(spec)

    for name, entry in (app.conf.beat_schedule or {}).items():
        add(functools.partial(builder.from_entry, name, entry), f"beat_schedule entry {name!r}")
    tasks = app.tasks
    for task_name in sorted(tasks):
        task = tasks[task_name]
        if getattr(task, "periodic_schedule", None) is not None:
            add(
                functools.partial(builder.from_task, task_name, task),
                f"task {task_name!r} (decorator)",
            )
    return specs


def schedule_from_spec(spec: ScheduleSpec, *, app: Celery) -> object:
    """The Celery schedule object a spec stands for (for display and for
    round trips): a ``crontab`` (whose ``tz`` is the spec's timezone), a
    ``schedule`` (with the spec's ``relative``), a ``solar``, a
    :class:`clocked` with an aware UTC time, or a custom schedule's own
    object. Raises InvalidSchedule for a definition that does not evaluate
    (a custom schedule read back from the store among them)."""
    compile_spec(spec)
    definition = spec.spec
    if isinstance(definition, CustomDefinition):
        return definition.schedule
    if spec.kind == "crontab":
        # celery-types lacks most crontab attributes; `Any` from here on.
        fields = {field: str(definition[field]) for field in CRON_FIELDS}
        cron: Any = read_crontab(f"schedule {spec.name!r}", fields).as_crontab(app=app)
        cron.tz = get_zone(spec.timezone)
        return cron
    if spec.kind == "interval":
        every = dt.timedelta(seconds=float(definition["seconds"]))
        return schedule(every, relative=spec.relative, app=app)
    if spec.kind == "solar":
        return solar(definition["event"], definition["lat"], definition["lon"], app=app)
    return clocked(parse_utc(str(definition["at"])), app=app)


#: The keywords of :meth:`SpecBuilder.build` that a beat entry or
#: ``Client.schedules.add`` may leave out.
OPTIONAL_FIELDS = (
    "args",
    "kwargs",
    "options",
    "timezone",
    "misfire",
    "overlap",
    "catchup_window",
    "max_catchup",
)


class SpecBuilder:
    """Builds specs against one app; resolves the app's timezone and the job
    validator once, for apps with many entries (and batches of schedules:
    ``Client.schedules.add_many``).

    :meth:`build` takes :func:`make_spec`'s arguments, all of them, and
    raises what it raises; :meth:`from_entry` and :meth:`from_task` read a
    ``beat_schedule`` entry and a decorated task."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.app_zone = _app_zone(app)
        # What beat waits for a custom schedule's check when is_due gives no
        # number of seconds (`celery beat --max-interval` is not seen here).
        self.max_interval = float(app.conf.beat_max_loop_interval or DEFAULT_MAX_INTERVAL)
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
            what,
            schedule,
            default_zone=self.app_zone,
            zone_name=zone_name,
            relative=relative,
            max_interval=self.max_interval,
        )
        if kind == "custom" and source != "static":
            raise InvalidSchedule(
                f"{what}: a custom schedule class ({definition['class']}) works only in "
                "app.conf.beat_schedule or the task decorator: the planner asks the object "
                "in the code, and a schedule added through the API has only its stored row; "
                "use a crontab, a schedule, a timedelta or number of seconds, a solar, a "
                "celery_sched.schedules.clocked or a cron string here"
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
        compile_spec(spec)  # the definition evaluates, or InvalidSchedule
        if kind == "custom":
            # Asked once now, so an object that raises or is never due is
            # refused with the entry's name before anything is written.
            first_after(spec, dt.datetime.now(dt.UTC))
        return spec

    def from_fields(
        self,
        name: Any,
        task: Any,
        schedule: object,
        fields: Mapping[str, Any],
        *,
        relative: Any,
        source: str,
        enabled: bool,
    ) -> ScheduleSpec:
        """:meth:`build`, its optional keywords read from ``fields`` (absent: ``None``)."""
        optional = {key: fields.get(key) for key in OPTIONAL_FIELDS}
        return self.build(
            name, task, schedule, **optional, relative=relative, source=source, enabled=enabled
        )

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
        return self.from_fields(
            name,
            entry["task"],
            entry["schedule"],
            entry,
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
    what: str,
    value: object,
    *,
    default_zone: str,
    zone_name: str | None,
    relative: bool,
    max_interval: float,
) -> tuple[str, dict[str, Any], str, bool]:
    """(kind, JSON spec, timezone name, relative) of a user's schedule value."""
    if isinstance(value, str):
        value = cron_from_string(what, value)
    if isinstance(value, crontab):
        cron: Any = value  # celery-types lacks the field attributes
        own = vars(cron).get("tz")  # set explicitly (cached_property), e.g. TzAwareCrontab
        if zone_name is None and own is not None:
            zone_name = _zone_name(own)
        fields = {
            "minute": cron_text(cron._orig_minute, cron.minute, 0, 60),
            "hour": cron_text(cron._orig_hour, cron.hour, 0, 24),
            "day_of_week": cron_text(cron._orig_day_of_week, cron.day_of_week, 0, 7),
            "day_of_month": cron_text(cron._orig_day_of_month, cron.day_of_month, 1, 31),
            "month_of_year": cron_text(cron._orig_month_of_year, cron.month_of_year, 1, 12),
        }
        return "crontab", fields, zone_name or default_zone, False
    if isinstance(value, schedule) and not _overrides_is_due(value):
        return (
            "interval",
            interval_definition(what, getattr(value, "run_every", None)),
            zone_name or default_zone,
            (relative or bool(value.relative)),
        )
    if isinstance(value, dt.timedelta) or (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    ):
        return "interval", interval_definition(what, value), zone_name or default_zone, relative
    if isinstance(value, solar):
        lat, lon = float(value.lat), float(value.lon)
        # solar() checks the ranges, which NaN passes; ephem then fails on it
        # with a bare ValueError at the first look for the next event.
        if not (math.isfinite(lat) and math.isfinite(lon)):
            raise InvalidSchedule(
                f"{what}: solar latitude and longitude must be finite, got {lat!r}, {lon!r}"
            )
        definition = {"event": value.event, "lat": lat, "lon": lon}
        return "solar", definition, zone_name or default_zone, False
    if isinstance(value, clocked):
        zone_name = zone_name or default_zone
        at = value.at_utc(get_zone(zone_name))  # AmbiguousTime / NonExistentTime
        return "clocked", {"at": format_utc(at)}, zone_name, False
    if is_custom_schedule(value):
        custom = CustomDefinition(value, max_interval=max_interval)
        return "custom", custom, zone_name or default_zone, False
    raise InvalidSchedule(
        f"{what}: unsupported schedule type {type(value).__name__}; use a crontab, a schedule, "
        "a timedelta or number of seconds, a solar, a celery_sched.schedules.clocked, "
        "a cron string, or (in beat_schedule and the decorator) an object with an "
        "is_due(last_run_at) method such as a celery.schedules.BaseSchedule subclass"
    )


def _overrides_is_due(value: schedule) -> bool:
    """Whether a subclass of Celery's interval ``schedule`` decides by itself
    when it is due: then it is a custom schedule, not an interval."""
    cls: Any = type(value)
    return bool(
        cls.is_due is not schedule.is_due
        or cls.remaining_estimate is not schedule.remaining_estimate
    )


def _check_name(name: Any) -> None:
    if type(name) is not str or not name.strip():
        raise InvalidSchedule(f"schedule name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidSchedule(
            f"schedule name must be at most {MAX_NAME_LENGTH} characters (it prefixes job "
            f"keys), got {len(name)}: {name[:40]!r}..."
        )
    check_text("schedule name", name, error=InvalidSchedule)


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
