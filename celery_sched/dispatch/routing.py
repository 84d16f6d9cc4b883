"""Where a job's message goes: Celery's routing, resolved once per route.

``send_task`` asks the app's routers for every message; the dispatcher asks
once per task name and per-job destination options (``queue``,
``exchange``, ``routing_key``) and keeps the :class:`Route`, except for a
task that ``task_routes`` may route by its arguments (a router function or
class before any map entry for it): those are resolved per job, with the
decoded arguments, and the routes interned. Every publish path sends by the
same :class:`Route`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from celery.app.routes import MapRoute
from kombu import Exchange, Queue
from kombu.common import Broadcast
from kombu.entity import maybe_delivery_mode

from celery_sched.models import Job, decode_body
from celery_sched.protocol import TaskDefaults, task_defaults

#: The key routes are cached by: the task name and the job's ``queue``,
#: ``exchange`` and ``routing_key`` options.
RouteKey = tuple[str, Any, Any, Any]

#: Job options ``send_task`` takes out of the options before it asks the
#: routers: they become headers, not routing.
_NOT_ROUTING = frozenset({"time_limit", "soft_time_limit", "ignore_result", "expires"})


@dataclasses.dataclass(frozen=True, slots=True)
class Route:
    """Where messages of one (task, per-job destination) go, and what the
    task declares for them (time limits, ``expires``)."""

    exchange: str
    routing_key: str
    queue: str | None
    delivery_mode: int | None
    priority: int | None
    declare: Queue | Exchange | None
    defaults: TaskDefaults | None = None
    #: The body's compression (the task's, ``task_routes``' or the app's
    #: ``task_compression``); None: sent as stored.
    compression: str | None = None


def routes_by_arguments(router: Any, task: str) -> bool:
    """Whether ``task_routes`` may route ``task`` by its arguments: a router
    other than a dict or glob map (a function, an import path, a router
    class) comes before any map entry matching the task name. Otherwise the
    route depends on the name and the job's destination options only."""
    for entry in router.routes:
        if not isinstance(entry, MapRoute):
            return True
        if entry(task) is not None:
            return False
    return False


class TaskRoutes:
    """The routes of an app's tasks, as ``send_task`` would resolve them.

    ``cache`` maps a :data:`RouteKey` to its route; the dispatcher looks
    there first (per job) and calls :meth:`resolve` on a miss. ``accept``
    gives the content types a body may be decoded from, for routers that
    route by the arguments (it raises when ``accept_content`` is invalid).
    """

    def __init__(self, app: Any, *, accept: Callable[[], frozenset[str]]) -> None:
        conf = app.conf
        self._app = app
        self._accept = accept
        self._compression: str | None = conf.task_compression or None
        self._default_delivery_mode = conf.task_default_delivery_mode
        self._default_priority: int | None = conf.task_default_priority
        self.cache: dict[RouteKey, Route] = {}
        # Per task name: whether its route is computed per job (see
        # routes_by_arguments); those routes are interned, since the Redis
        # envelopes cache per route object.
        self._by_arguments: dict[str, bool] = {}
        self._interned: dict[Route, Route] = {}

    def resolve(self, job: Job, route_key: RouteKey) -> Route:
        """The route of ``job``, not found in the cache of ``route_key``s:
        resolved once and cached, or, when ``task_routes`` may route the
        task by its arguments, resolved for this job alone."""
        task = job.task
        by_arguments = self._by_arguments.get(task)
        if by_arguments is None:
            by_arguments = self._by_arguments[task] = routes_by_arguments(
                self._app.amqp.router, task
            )
        if not by_arguments:
            route = self.cache[route_key] = self._resolve(*route_key)
            return route
        args, kwargs = decode_body(
            job.body,
            job.content_type,
            job.content_encoding,
            self._accept(),
            f"the body of job {job.key!r}",
        )
        route = self._resolve(
            task,
            None,
            None,
            None,
            args=args,
            kwargs=kwargs,
            job_options=job.options,
        )
        return self._interned.setdefault(route, route)

    def _resolve(
        self,
        task: str,
        queue: Any,
        exchange: Any,
        routing_key: Any,
        *,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        job_options: Any = None,
    ) -> Route:
        """Route like ``send_task``: task options < task_routes < the job's own.

        The routers get what ``send_task`` gives them: the task name, the
        job's ``args`` and ``kwargs`` (empty when the route is cached per
        task name: only maps are configured for it) and the options, the
        task's own under the job's.
        """
        app = self._app
        amqp_ = app.amqp
        options: dict[str, Any] = {}
        task_type = app.tasks.get(task)
        if task_type is not None:
            for name in ("queue", "exchange", "routing_key", "priority", "compression"):
                value = getattr(task_type, name, None)
                if value is not None:
                    options[name] = value
        for name, value in (("queue", queue), ("exchange", exchange), ("routing_key", routing_key)):
            if value is not None:
                options[name] = value
        if job_options:
            for name, value in job_options.items():
                if name not in _NOT_ROUTING:
                    options[name] = value
        route = amqp_.router.route(options, task, args, kwargs or {}, task_type)

        dest = route.get("queue")
        exch = route.get("exchange")
        rkey = route.get("routing_key")
        if dest is None and exch is None:
            dest = amqp_.default_queue
        if isinstance(dest, str):
            dest = amqp_.queues[dest]
        qname = dest.name if dest is not None else None

        delivery_mode = route.get("delivery_mode")
        if delivery_mode is None and dest is not None:
            delivery_mode = dest.exchange.delivery_mode
        delivery_mode = maybe_delivery_mode(delivery_mode or self._default_delivery_mode)

        exchange_type = route.get("exchange_type")
        if exchange_type is None:
            exchange_type = dest.exchange.type if dest is not None else "direct"
        declare: Queue | Exchange | None = None
        if (not exch or not rkey) and exchange_type == "direct":
            # The default exchange delivers straight to the queue named by
            # the routing key: no exchange lookup on the broker.
            exch, rkey = "", qname
        elif exch is None:
            exch = dest.exchange.name or amqp_.default_exchange.name
            rkey = rkey or dest.routing_key or app.conf.task_default_routing_key
        if dest is not None and not isinstance(dest, Broadcast):
            declare = dest
        elif isinstance(exch, Exchange):
            declare = exch
        if isinstance(exch, Exchange):
            exch = exch.name
        priority = route.get("priority", self._default_priority)
        return Route(
            exchange=exch or "",
            routing_key=rkey or "",
            queue=qname,
            delivery_mode=delivery_mode,
            priority=priority,
            declare=declare,
            defaults=task_defaults(task_type),
            compression=route.get("compression") or self._compression,
        )
