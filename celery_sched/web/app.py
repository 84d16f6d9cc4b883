"""The console's Starlette application: pages, actions and their guards.

Every page is a function returning its template's name and a JSON-able
``data`` mapping, so ``?format=json`` answers the same data the HTML shows.
Every change is a POST to ``/actions/<op>`` carrying the CSRF token of the
double-submit cookie, and calls the same :class:`~celery_sched.client.Client`
method the command line does. The client is synchronous; handlers run it in
Starlette's thread pool so a slow query never stalls the event loop. Around
it all, :class:`HostShield` answers only the Host names the console is served
under and puts the browser security headers on every response.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import hmac
import ipaddress
import json
import logging
import re
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from celery_sched.client import Client
from celery_sched.errors import CelerySchedError, ConfigurationError, InvalidCursor
from celery_sched.models import (
    REQUEUABLE_STATUSES,
    Job,
    JobQuery,
    JobStatus,
    ScheduleInfo,
    dispatch_lag,
)
from celery_sched.models.listing import job_fields
from celery_sched.web.words import bar_chart, cron_text, schedule_words

logger = logging.getLogger(__name__)

CSRF_COOKIE = "celery_sched_csrf"
CSRF_FIELD = "csrf"
#: Jobs per page of the jobs list (one more row is read to know if a next page exists).
PAGE_SIZE = 50
_EDITABLE_KINDS = frozenset({"crontab", "interval"})
_TEMPLATES = Path(__file__).parent / "templates"
_STYLESHEET = Path(__file__).parent / "static" / "console.css"

#: The names a browser on this machine reaches a loopback console by.
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
#: On every response. The pages need only their own stylesheet, inline SVG
#: (not governed by the policy) and forms posting back to the console; no
#: script, frame, image or inline style is allowed.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
}
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_.-]*[a-z0-9_])?\Z")

Handler = Callable[[Request], Awaitable[Response]]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Credentials:
    """The ``user:password`` pair HTTP Basic auth asks for."""

    user: str
    password: str

    @classmethod
    def parse(cls, text: str) -> Credentials:
        user, sep, password = text.partition(":")
        if not sep or not user or not password:
            raise ConfigurationError("web console auth must be 'user:password', both non-empty")
        return cls(user=user, password=password)

    def accepts(self, header: str | None) -> bool:
        """Whether an ``Authorization`` header carries these credentials; both
        parts are compared in constant time, always, so timing tells nothing."""
        scheme, _, encoded = (header or "").partition(" ")
        try:
            given = base64.b64decode(encoded, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            given = ""
        user, _, password = given.partition(":")
        user_ok = hmac.compare_digest(user.encode(), self.user.encode())
        password_ok = hmac.compare_digest(password.encode(), self.password.encode())
        return scheme.lower() == "basic" and user_ok and password_ok


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the console on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, auth: Credentials | None, insecure: bool) -> None:
    """Refuse to open the console beyond loopback without auth, unless told."""
    if not is_loopback(host) and auth is None and not insecure:
        raise ConfigurationError(
            f"binding the web console to {host} (not loopback) needs --auth user:password "
            "(or celery_sched_web_auth), or --insecure to serve it to anyone who can reach it"
        )


def _split_host(text: str) -> tuple[str, int | None] | None:
    """``(name, port)`` of ``host[:port]``, the name lower-case and an IPv6
    address in brackets; None when ``text`` is no such thing."""
    text = text.strip().lower()
    if text.startswith("["):
        inside, sep, rest = text[1:].partition("]")
        name, port = f"[{inside}]", rest.removeprefix(":")
        if not sep or (rest and not rest.startswith(":")):
            return None
        address = inside
    elif text.count(":") > 1:  # a bare IPv6 address, no port
        name, port, address = f"[{text}]", "", text
    else:
        name, _, port = text.partition(":")
        address = ""
        if ":" in text and not port:
            return None
    if address:
        try:
            ipaddress.IPv6Address(address)
        except ValueError:
            return None
    elif not _HOST_NAME.match(name):
        return None
    if not port:
        return name, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return name, int(port)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AllowedHosts:
    """The Host names the console answers: a name alone allows it on any
    port, ``name:port`` on that port only."""

    names: frozenset[str]
    name_ports: frozenset[tuple[str, int]]

    @classmethod
    def of(cls, hosts: Iterable[str], *, bind: str | None = None) -> AllowedHosts:
        """The loopback names, the address ``bind`` (unless it is every
        interface) and ``hosts``; a bad entry raises ConfigurationError."""
        names = set(LOOPBACK_HOSTS)
        name_ports: set[tuple[str, int]] = set()
        if bind is not None and bind.strip("[]") not in ("", "0.0.0.0", "::"):  # noqa: S104
            found = _split_host(bind)
            if found is not None:
                names.add(found[0])
        for entry in hosts:
            found = _split_host(entry)
            if found is None:
                raise ConfigurationError(
                    f"allowed host {entry!r} is not a host name or address with an optional "
                    "port (e.g. console.example.com, 10.0.0.5 or 10.0.0.5:8808)"
                )
            name, port = found
            if port is None:
                names.add(name)
            else:
                name_ports.add((name, port))
        return cls(names=frozenset(names), name_ports=frozenset(name_ports))

    def allow(self, header: str) -> bool:
        """Whether a request with this ``Host`` header is served."""
        found = _split_host(header)
        if found is None:
            return False
        name, port = found
        return name in self.names or (port is not None and (name, port) in self.name_ports)


class HostShield:
    """The console's outer layer: a request whose Host is not allowed gets a
    400 before any route runs (a DNS-rebinding page reaches the console under
    its own name), and every response carries :data:`SECURITY_HEADERS`."""

    def __init__(self, app: ASGIApp, allowed: AllowedHosts) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        hosts = [value.decode("latin-1") for key, value in scope["headers"] if key == b"host"]
        if len(hosts) != 1 or not self.allowed.allow(hosts[0]):
            logger.warning(
                "web console: refused a request for Host %r (serve a name with --allowed-host)",
                hosts[0][:100] if len(hosts) == 1 else hosts,
            )
            refusal = PlainTextResponse("invalid Host header\n", status_code=400)
            await refusal(scope, receive, secured)
            return
        await self.app(scope, receive, secured)


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if hasattr(value, "value"):  # an Enum
        return value.value
    return str(value)


def _when(value: dt.datetime | None) -> str:
    return "—" if value is None else value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def job_row(job: Job) -> dict[str, Any]:
    """A job as the list and detail pages (and their JSON) show it: the
    fields ``sched job --json`` prints, and its dispatch lag."""
    return {**job_fields(job), "lag": dispatch_lag(job)}


def schedule_row(info: ScheduleInfo) -> dict[str, Any]:
    """A schedule as the list and detail pages (and their JSON) show it."""
    if not info.enabled:
        state = "disabled"
    elif info.broken_at is not None or info.undecodable is not None:
        state = "broken"
    elif info.paused:
        state = "paused"
    else:
        state = "active"
    return {
        "name": info.name,
        "task": info.task,
        "kind": info.kind,
        "spec": dict(info.spec),
        "words": schedule_words(info.kind, info.spec, info.timezone),
        "timezone": info.timezone,
        "misfire": info.misfire,
        "overlap": info.overlap,
        "next_run_at": info.next_run_at,
        "last_run_at": info.last_run_at,
        "last_status": None if info.last_status is None else info.last_status.value,
        "state": state,
        "paused": info.paused,
        "source": info.source,
        "in_code": info.source == "static",
        "editable": info.source != "static" and info.kind in _EDITABLE_KINDS,
        "broken_reason": info.broken_reason,
        "cron": cron_text(info.spec) if info.kind == "crontab" else "",
        "seconds": info.spec.get("seconds") if info.kind == "interval" else None,
    }


class BadInput(CelerySchedError, ValueError):
    """A form or query field the console cannot use; the page says which."""


def _parse_time(field: str, text: str) -> dt.datetime | None:
    text = text.strip()
    if not text:
        return None
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        raise BadInput(
            f"{field}: {text!r} is not an ISO 8601 time (e.g. 2031-05-01T10:00)"
        ) from None
    return parsed.replace(tzinfo=dt.UTC) if parsed.tzinfo is None else parsed.astimezone(dt.UTC)


class Console:
    """The pages and actions over one client."""

    def __init__(self, client: Client, *, auth: Credentials | None = None) -> None:
        self.client = client
        self.auth = auth
        self.stylesheet = _STYLESHEET.read_text()
        self.env = Environment(
            loader=FileSystemLoader(_TEMPLATES),
            # Everything a user typed (names, keys, errors, args) is escaped.
            autoescape=select_autoescape(default=True, default_for_string=True),
        )
        self.env.filters["when"] = _when

    # -- plumbing ------------------------------------------------------------------

    def _render(
        self,
        request: Request,
        template: str,
        data: Mapping[str, Any],
        *,
        status: int = 200,
        extra: Mapping[str, Any] | None = None,
    ) -> Response:
        if request.query_params.get("format") == "json":
            body = json.dumps(data, default=_json_default, sort_keys=True)
            return Response(body, status_code=status, media_type="application/json")
        token = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
        html = self.env.get_template(template).render(
            **data, **(extra or {}), csrf=token, page=template.removesuffix(".html")
        )
        response = HTMLResponse(html, status_code=status)
        if request.cookies.get(CSRF_COOKIE) != token:
            # Double-submit: a form posts the cookie's value back; another
            # site can make the browser send the cookie but cannot read it.
            response.set_cookie(CSRF_COOKIE, token, httponly=True, samesite="strict")
        return response

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            if self.auth is not None and not self.auth.accepts(
                request.headers.get("authorization")
            ):
                return Response(
                    "authentication required\n",
                    status_code=401,
                    headers={"WWW-Authenticate": 'Basic realm="celery_sched"'},
                )
            try:
                return await handler(request)
            except BadInput as exc:
                return self._render(request, "error.html", {"error": str(exc)}, status=400)
            except CelerySchedError as exc:
                # A missing schema or a lost database: one line, not a traceback.
                logger.warning("web console: %s: %s", type(exc).__name__, exc)
                error = f"{type(exc).__name__}: {exc}"
                return self._render(request, "error.html", {"error": error}, status=503)

        return guarded

    async def _form(self, request: Request) -> dict[str, str]:
        """The posted form, or a 403 (raised as _Forbidden) without a matching CSRF token."""
        form = await request.form()
        fields = {key: str(value) for key, value in form.items()}
        cookie = request.cookies.get(CSRF_COOKIE, "")
        given = fields.pop(CSRF_FIELD, "")
        if not cookie or not hmac.compare_digest(cookie.encode(), given.encode()):
            raise _Forbidden
        return fields

    def routes(self) -> list[Route]:
        pages: list[tuple[str, Handler]] = [
            ("/", self.overview),
            ("/schedules", self.schedules),
            ("/schedules/{name:path}", self.schedule),
            ("/jobs", self.jobs),
            ("/jobs/{key:path}", self.job),
        ]
        routes = [Route(path, self._guard(handler)) for path, handler in pages]
        routes.append(Route("/actions/{op}", self._guard(self.action), methods=["POST"]))
        # Outside the auth guard: it holds no data, and a browser fetching it
        # for the login page has no credentials to send yet.
        routes.append(Route("/console.css", self.css))
        return routes

    async def css(self, request: Request) -> Response:
        return Response(self.stylesheet, media_type="text/css")

    # -- pages -------------------------------------------------------------------------

    async def overview(self, request: Request) -> Response:
        data = await run_in_threadpool(self._overview_data)
        charts = {
            "rate_chart": bar_chart(
                [(at, value) for at, value, _ in data["per_minute"]],
                unit=" jobs",
                title="jobs dispatched per minute, last hour",
            ),
            "lag_chart": bar_chart(
                [(at, lag) for at, _, lag in data["per_minute"]],
                unit=" s",
                title="mean dispatch lag per minute, last hour",
            ),
        }
        return self._render(request, "overview.html", data, extra=charts)

    def _overview_data(self) -> dict[str, Any]:
        client = self.client
        epochs = client.epochs()
        leaders = []
        for view in client.leaders():
            report = view.report
            leaders.append(
                {
                    "shard": view.shard,
                    "holder": view.holder,
                    "lease_left": None if view.ttl is None else round(view.ttl, 1),
                    "epoch": epochs.get(view.shard, 0),
                    "host": report.host if report is not None else view.holder,
                    "last_pass_at": None if report is None else report.pass_at,
                }
            )
        counts = {status.value: count for status, count in client.counts_by_status().items()}
        oldest = client.list_jobs(JobQuery(statuses=frozenset({JobStatus.PENDING})), limit=1)
        now = client.store.now()
        backlog_job = oldest.jobs[0] if oldest.jobs else None
        backlog = None
        if backlog_job is not None and backlog_job.due_at <= now:
            backlog = {
                "key": backlog_job.key,
                "due_at": backlog_job.due_at,
                "behind": (now - backlog_job.due_at).total_seconds(),
            }
        per_minute = self._last_hour(now)
        failures = client.recent_failures(limit=10)
        return {
            "leaders": leaders,
            "counts": counts,
            "total": sum(counts.values()),
            "backlog": backlog,
            "per_minute": per_minute,
            "failures": [job_row(job) for job in failures],
            "now": now,
        }

    def _last_hour(self, now: dt.datetime) -> list[tuple[dt.datetime, int, float]]:
        """Per minute of the last hour: the jobs due then that were
        dispatched, and their mean dispatch lag (one aggregate in the store,
        whatever the hour's volume)."""
        start = (now - dt.timedelta(hours=1)).replace(second=0, microsecond=0)
        found = self.client.dispatches_by_minute(since=start, until=now)
        minutes = (start + dt.timedelta(minutes=i) for i in range(61))
        return [
            (at, found[at].count, found[at].mean_lag) if at in found else (at, 0, 0.0)
            for at in minutes
        ]

    async def schedules(self, request: Request) -> Response:
        infos = await run_in_threadpool(self.client.schedules.list)
        data = {"schedules": [schedule_row(info) for info in infos]}
        return self._render(request, "schedules.html", data)

    async def schedule(
        self,
        request: Request,
        *,
        errors: Mapping[str, str] | None = None,
        values: Mapping[str, str] | None = None,
    ) -> Response:
        name = request.path_params.get("name") or (values or {}).get("name", "")
        found = await run_in_threadpool(self._schedule_data, name)
        if found is None:
            return self._render(
                request, "error.html", {"error": f"no schedule called {name!r}"}, status=404
            )
        data, points = found
        data = {**data, "errors": dict(errors or {}), "values": dict(values or {})}
        chart = bar_chart(points, width=400, height=80, unit=" s", title="dispatch lag per run")
        return self._render(
            request,
            "schedule.html",
            data,
            status=400 if errors else 200,
            extra={"lag_chart": chart},
        )

    def _schedule_data(
        self, name: str
    ) -> tuple[dict[str, Any], list[tuple[dt.datetime, float]]] | None:
        info = self.client.schedules.get(name)
        if info is None:
            return None
        runs = self.client.schedules.history(name, limit=50)
        points = [(job.due_at, dispatch_lag(job) or 0.0) for job in reversed(runs)]
        return {"schedule": schedule_row(info), "runs": [job_row(job) for job in runs]}, points

    async def jobs(self, request: Request) -> Response:
        params = request.query_params
        status = params.get("status", "")
        if status and status not in {s.value for s in JobStatus}:
            raise BadInput(f"status: {status!r} is not a job status")
        query = JobQuery(
            statuses=frozenset({JobStatus(status)}) if status else frozenset(),
            task=params.get("task") or None,
            key_prefix=params.get("prefix") or None,
            due_after=_parse_time("due from", params.get("due_after", "")),
            due_before=_parse_time("due before", params.get("due_before", "")),
        )
        after = params.get("after") or None
        try:
            page = await run_in_threadpool(
                self.client.list_jobs, query, after=after, limit=PAGE_SIZE
            )
        except InvalidCursor as exc:
            raise BadInput(str(exc)) from exc
        filters = {
            key: params.get(key, "")
            for key in ("prefix", "task", "status", "due_after", "due_before")
        }
        data = {
            "jobs": [job_row(job) for job in page.jobs],
            "next": None if page.next is None else page.next.encode(),
            "filters": filters,
        }
        return self._render(
            request,
            "jobs.html",
            data,
            extra={"statuses": [s.value for s in JobStatus]},
        )

    async def job(self, request: Request) -> Response:
        key = request.path_params["key"]
        found = await run_in_threadpool(self._job_data, key)
        if found is None:
            return self._render(
                request, "error.html", {"error": f"no job with key {key!r}"}, status=404
            )
        return self._render(request, "job.html", found)

    def _job_data(self, key: str) -> dict[str, Any] | None:
        job = self.client.get(key)
        if job is None:
            return None
        try:
            headers = self.client.message_headers(job)
        except CelerySchedError as exc:
            headers = {"error": str(exc)}
        return {
            "job": job_row(job),
            # Made plain JSON here so the template's tojson never meets a datetime.
            "headers": json.loads(json.dumps(headers, default=_json_default)),
            "cancellable": job.status is JobStatus.PENDING,
            "requeuable": job.status in REQUEUABLE_STATUSES,
        }

    # -- actions --------------------------------------------------------------------------

    async def action(self, request: Request) -> Response:
        try:
            fields = await self._form(request)
        except _Forbidden:
            return Response("missing or wrong CSRF token\n", status_code=403)
        op = request.path_params["op"]
        if op == "edit":
            return await self._edit(request, fields)
        handler = _ACTIONS.get(op)
        if handler is None:
            return Response(f"unknown action {op!r}\n", status_code=404)
        try:
            where = await run_in_threadpool(handler, self.client, fields)
        except CelerySchedError as exc:
            return self._render(request, "error.html", {"error": str(exc)}, status=400)
        return RedirectResponse(where, status_code=303)

    async def _edit(self, request: Request, fields: dict[str, str]) -> Response:
        errors = await run_in_threadpool(self._apply_edit, fields)
        if errors:
            request.path_params["name"] = fields.get("name", "")
            return await self.schedule(request, errors=errors, values=fields)
        return RedirectResponse(_schedule_url(fields.get("name", "")), status_code=303)

    def _apply_edit(self, fields: Mapping[str, str]) -> dict[str, str]:
        """Check each changed field alone (so an error lands next to its
        field), then write them together; any error writes nothing."""
        name = fields.get("name", "")
        manager = self.client.schedules
        info = manager.get(name)
        if info is None:
            return {"form": f"no schedule called {name!r}"}
        if info.source == "static" or info.kind not in _EDITABLE_KINDS:
            return {"form": "this schedule is defined in code (or of a kind edited in code only)"}
        current: dict[str, Any] = {
            "name": name,
            "task": info.task,
            "timezone": info.timezone,
            "schedule": cron_text(info.spec) if info.kind == "crontab" else info.spec["seconds"],
        }
        changes: dict[str, Any] = {}
        errors: dict[str, str] = {}
        text = fields.get("schedule", "").strip()
        if text:
            if info.kind == "interval":
                try:
                    changes["schedule"] = float(text)
                except ValueError:
                    errors["schedule"] = f"{text!r} is not a number of seconds"
            else:
                changes["schedule"] = text
        for field in ("timezone", "overlap"):
            value = fields.get(field, "").strip()
            if value:
                changes[field] = value
        # The form's "(default)" choice is an empty value: the project's
        # default policy again (stored as NULL); a form without the field
        # leaves the policy alone.
        if "misfire" in fields:
            misfire = fields["misfire"].strip() or None
            if misfire != info.misfire:
                changes["misfire"] = misfire
        for field, value in changes.items():
            if value is None:
                continue  # a policy back to its default: nothing to check
            try:
                manager.check({**current, field: value}, check_task=False)
            except (CelerySchedError, ValueError) as exc:
                errors[field] = str(exc)
        if errors:
            return errors
        try:
            manager.update(name, check_task=False, **changes)
        except (CelerySchedError, ValueError) as exc:
            return {"form": str(exc)}
        return {}


class _Forbidden(Exception):
    """A POST without the CSRF token of its cookie."""


def _schedule_url(name: str) -> str:
    from urllib.parse import quote

    return "/schedules/" + quote(name, safe="")


def _job_url(key: str) -> str:
    from urllib.parse import quote

    return "/jobs/" + quote(key, safe="")


def _pause(client: Client, fields: Mapping[str, str]) -> str:
    client.schedules.pause(fields["name"])
    return _schedule_url(fields["name"])


def _resume(client: Client, fields: Mapping[str, str]) -> str:
    client.schedules.resume(fields["name"])
    return _schedule_url(fields["name"])


def _trigger(client: Client, fields: Mapping[str, str]) -> str:
    job = client.schedules.trigger(fields["name"])
    return _schedule_url(fields["name"]) if job is None else _job_url(job.key)


def _delete(client: Client, fields: Mapping[str, str]) -> str:
    if fields.get("confirm") != fields["name"]:
        raise BadInput("type the schedule's name to confirm its deletion")
    client.schedules.delete(fields["name"])
    return "/schedules"


def _cancel(client: Client, fields: Mapping[str, str]) -> str:
    if not client.cancel(fields["key"]):
        raise BadInput(f"job {fields['key']!r} is unknown or no longer pending; nothing cancelled")
    return _job_url(fields["key"])


def _requeue(client: Client, fields: Mapping[str, str]) -> str:
    result = client.requeue([fields["key"]])
    if not result.requeued:
        raise BadInput(f"job {fields['key']!r} is not dead or failed; nothing requeued")
    return _job_url(fields["key"])


def _requeue_dead(client: Client, fields: Mapping[str, str]) -> str:
    task = fields.get("task", "").strip() or None
    count = client.requeue_dead(task=task)
    logger.info("web console requeued %d dead jobs (task %s)", count, task or "any")
    return f"/jobs?status=pending&requeued={count}"


_ACTIONS: dict[str, Callable[[Client, Mapping[str, str]], str]] = {
    "pause": _pause,
    "resume": _resume,
    "trigger": _trigger,
    "delete": _delete,
    "cancel": _cancel,
    "requeue": _requeue,
    "requeue-dead": _requeue_dead,
}


def create_app(
    client: Client,
    *,
    auth: Credentials | None = None,
    allowed_hosts: Iterable[str] = (),
    bind: str | None = None,
) -> ASGIApp:
    """The console's ASGI app over ``client`` (which the caller closes).

    It answers requests whose Host is a loopback name, the address ``bind``
    it is served on, or one of ``allowed_hosts`` (``name`` or ``name:port``),
    and refuses any other with 400.
    """
    allowed = AllowedHosts.of(allowed_hosts, bind=bind)
    return HostShield(Starlette(routes=Console(client, auth=auth).routes()), allowed)
