"""The drop-in face: ``celery -A proj beat -S celery_sched``.

:class:`Scheduler` is a ``celery.beat.Scheduler`` whose ``tick`` runs one pass
of the beat's :class:`~celery_sched.leader.fleet.Fleet` (an engine per shard
it competes for; every beat without a pinned ``celery_sched_shard`` shares the
shards with the others) and returns how long to sleep.
Constructed with ``lazy=True`` (as the start-up banner does) it connects to
nothing. It touches neither SQL nor Redis itself: it opens the store and hands
the rest to :func:`celery_sched.backends.build_leader`.

Periodic schedules: at setup it reads the app's static schedules
(``beat_schedule``, ``add_periodic_task`` entries, ``@app.task(base=Task,
schedule=...)``, and beat's own ``celery.backend_cleanup`` when beat would add
it) and hands them to the engines' planners, whose leader writes them into
PostgreSQL. It keeps no per-entry state: ``self.data`` stays empty, and what
is due is read from the store a batch at a time, so memory does not grow with
the number of schedules stored.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

from celery import beat

from celery_sched.settings import Settings

if TYPE_CHECKING:
    from celery_sched.interfaces import JobStore

logger = logging.getLogger(__name__)

#: Seconds ``tick`` sleeps after a pass that raised.
ERROR_DELAY = 1.0


def check_shards(store: JobStore, shards: int) -> None:
    """Warn when unfinished jobs sit in shards ``>= shards`` (the count was
    lowered): no beat leads them until they are moved, which shard 0's
    leader does (:mod:`celery_sched.leader.rehoming`), soonest due first,
    or ``celery -A proj sched reshard`` at once."""
    stranded = store.unfinished_by_shard(from_shard=shards)
    if not stranded:
        return
    parts = []
    for shard in sorted(stranded):
        counts = ", ".join(
            f"{count} {status.value}" for status, count in sorted(stranded[shard].items())
        )
        parts.append(f"shard {shard}: {counts}")
    logger.warning(
        "celery_sched_shards is %d, but unfinished jobs are stored in shards %d..%d (%s); "
        "shard 0's leader will move them to the shard their key hashes to "
        "(or run: celery -A proj sched reshard)",
        shards,
        min(stranded),
        max(stranded),
        "; ".join(parts),
    )


class StopAfterPass:
    """Holds SIGTERM and SIGINT that arrive during a pass until it ends.

    ``celery beat`` stops on these signals by closing the scheduler and
    raising ``SystemExit`` from wherever the main thread is. In the middle of
    a pass that is between a claim and its publish: the claimed jobs would
    stay ``dispatched``, unsent, until the reconciler requeues them a
    visibility timeout later. Wrapped by this guard, beat's handler runs once
    the pass is over (its jobs published or released); a second signal during
    the same pass runs it at once, for a pass that hangs.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._previous: dict[int, Callable[[int, FrameType | None], Any]] = {}
        self._in_pass = False
        self._pending: int | None = None

    def install(self) -> bool:
        """Wrap the current handlers (in the main thread only, where Python
        runs them); False when there was nothing to wrap."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in self.SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler) and signum not in self._previous:
                self._previous[signum] = handler
                signal.signal(signum, self._handle)
        return bool(self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._in_pass and self._pending is None:
            self._pending = signum
            logger.info(
                "celery_sched: %s received during a pass; stopping when it ends "
                "(send it again to stop at once)",
                signal.Signals(signum).name,
            )
            return
        self._pending = None
        self._previous[signum](signum, frame)

    @contextmanager
    def running(self) -> Iterator[None]:
        """A pass: a signal arriving inside waits for its end."""
        self._in_pass = True
        try:
            yield
        finally:
            self._in_pass = False
            pending, self._pending = self._pending, None
            if pending is not None:
                self._previous[pending](pending, None)


#: Settings given on the beat's command line (``--metrics-port``); they win
#: over the app's configuration and the environment, as command-line options
#: do. Filled by :mod:`celery_sched.cli.beat_options` before beat starts.
COMMAND_LINE: dict[str, Any] = {}


def _role_line(settings: Settings) -> str:
    if settings.shard is not None:
        return f"pinned to shard {settings.shard} of {settings.shards}"
    return (
        f"sharing {settings.shards} shard(s) with the other beats "
        "(each leads at most ceil(shards / live beats))"
    )


class Scheduler(beat.Scheduler):
    """Celery beat scheduler backed by PostgreSQL, Redis and a fenced lease."""

    def __init__(self, app: Any, *args: Any, **kwargs: Any) -> None:
        self._fleet: Any = None
        self._metrics: Any = None
        self._settings: Settings | None = None
        self._stop_guard: StopAfterPass | None = None
        super().__init__(app, *args, **kwargs)

    # -- celery.beat.Scheduler overrides -----------------------------------

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_app(self.app, **COMMAND_LINE)
        return self._settings

    def setup_schedule(self) -> None:
        from celery_sched.backends import build_fleet, build_store

        settings = self.settings
        # Before connecting anywhere. An entry that cannot be handled is
        # logged at ERROR with its name and left out; the others run.
        static = self._static_specs()
        store = build_store(settings)
        # Idempotent and serialized by an advisory lock, so every beat of a
        # fleet may run it at start; the first one creates the schema.
        store.migrate()
        try:
            check_shards(store, settings.shards)
        except BaseException:
            store.close()
            raise
        self._fleet = build_fleet(self.app, settings, store=store, static=static)
        self._fleet.start()
        self._serve_metrics(settings)
        logger.info(
            "celery_sched: %s (store %s, redis %s); %d periodic schedules in code",
            _role_line(settings),
            settings.safe_database_url,
            settings.safe_redis_url,
            len(static),
        )

    def _serve_metrics(self, settings: Settings) -> None:
        """``/metrics``, ``/healthz`` and ``/readyz`` on ``celery_sched_metrics_port``."""
        if not settings.metrics_port or self._metrics is not None:
            return
        try:
            from celery_sched.metrics.beat import serve

            self._metrics = serve(self._fleet, settings)
        except Exception:
            # (serve() logs and swallows its own failures; this is the
            # last guard: the beat must never die from its metrics.)
            logger.exception("celery_sched: metrics not served")

    def _static_specs(self) -> list[Any]:
        """The code's periodic schedules, plus ``celery.backend_cleanup`` where
        stock beat installs it (results that expire on a backend that cannot
        expire them itself)."""
        from celery.schedules import crontab

        from celery_sched import schedules

        specs = schedules.specs_from_app(self.app, skip_invalid=True)
        cleanup = "celery.backend_cleanup"
        if (
            self.app.conf.result_expires
            and not self.app.backend.supports_autoexpire
            and all(spec.name != cleanup for spec in specs)
        ):
            specs.append(
                schedules.make_spec(
                    cleanup,
                    cleanup,
                    crontab("0", "4", "*"),
                    app=self.app,
                    options={"expires": 12 * 3600},
                    source="static",
                )
            )
        return specs

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if self._fleet is None:
            self.setup_schedule()
        if self._stop_guard is None:
            # Here, not at setup: beat installs its own handlers before the
            # scheduler is made, and ticks run in the thread that handles them.
            self._stop_guard = StopAfterPass()
            self._stop_guard.install()
        try:
            with self._stop_guard.running():
                delay: float = self._fleet.step()
        except Exception:
            # Fleet.step never raises; should that ever break, beat must
            # still not exit (celery.beat.Service ends on any exception).
            logger.exception("celery_sched: leader pass failed; retrying")
            return ERROR_DELAY
        return delay

    def should_sync(self) -> bool:
        return False

    def sync(self) -> None:
        """Nothing to persist: every state change is already in Postgres."""

    def close(self) -> None:
        metrics, self._metrics = self._metrics, None
        if metrics is not None:
            try:
                metrics.close()
            except Exception:
                logger.exception("celery_sched: closing the metrics server failed")
        fleet, self._fleet = self._fleet, None
        if fleet is not None:
            fleet.stop()
        super().close()

    @property
    def info(self) -> str:
        settings = self.settings
        lines = [
            f"    . shards -> {_role_line(settings)}",
            f"    . store -> {settings.safe_database_url} (schema {settings.db_schema}; "
            f"from {settings.origin('database_url')})",
            f"    . redis -> {settings.safe_redis_url} (prefix {settings.key_prefix}; "
            f"from {settings.origin('redis_url')})",
        ]
        if self._fleet is not None:
            leading = self._fleet.leading()
            lines.insert(
                0,
                f"    . role -> leading {len(leading)} shard(s)"
                + (f": {', '.join(map(str, leading))}" if leading else ""),
            )
        else:
            lines.insert(0, "    . role -> not started")
        lines.append(f"    . schedules -> {self._schedule_count()}")
        if settings.metrics_port:
            lines.append(
                f"    . metrics -> port {settings.metrics_port} (/metrics, /healthz, /readyz)"
            )
        return "\n".join(lines)

    def _schedule_count(self) -> str:
        """How many periodic schedules the code defines (counted without
        validating them; the store may hold more, added through the API)."""
        entries = len(self.app.conf.beat_schedule or {})
        decorated = sum(
            1
            for task in self.app.tasks.values()
            if getattr(task, "periodic_schedule", None) is not None
        )
        return (
            f"{entries + decorated} in code ({entries} beat_schedule, {decorated} decorated); "
            "all stored ones: celery -A proj sched schedules"
        )
