"""The ``sched`` command group and what its commands share.

Every error a command can meet becomes one line on stderr and exit status 1:
celery_sched's own errors name the problem, and an unreachable PostgreSQL or
Redis is said in words, never as a traceback and never with a password.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Iterator, Sequence
from typing import Any

import click

from celery_sched.client import Client
from celery_sched.errors import CelerySchedError
from celery_sched.settings import Settings


@contextlib.contextmanager
def clean_errors() -> Iterator[None]:
    """Turn celery_sched, settings and connection errors into one-line click errors."""
    try:
        yield
    except click.ClickException:
        raise
    except CelerySchedError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    except ValueError as exc:
        # Settings parsing can still surface a bare ValueError (a URL with a
        # non-numeric port); its message carries no password.
        raise click.ClickException(f"invalid celery_sched configuration: {exc}") from exc
    except Exception as exc:
        reason = _unreachable(exc)
        if reason is None:
            raise
        raise click.ClickException(reason) from exc


def _unreachable(exc: BaseException) -> str | None:
    """A one-line reason for a lost database or Redis connection, else None."""
    import psycopg
    import redis

    if isinstance(exc, psycopg.OperationalError):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"PostgreSQL is unreachable: {first}"
    if isinstance(exc, redis.RedisError):
        return f"Redis is unreachable or refused the command: {exc}"
    return None


class SchedGroup(click.Group):
    """A click group whose commands never end in a traceback on a lost service."""

    def invoke(self, ctx: click.Context) -> Any:
        with clean_errors():
            return super().invoke(ctx)


def app_of(ctx: click.Context) -> Any:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("run as `celery -A proj sched ...` so the Celery app is known")
    return app


def client_of(ctx: click.Context) -> Client:
    app = app_of(ctx)
    with clean_errors():
        return Client(app, settings=Settings.from_app(app))


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if hasattr(value, "value"):  # an Enum
        return value.value
    return str(value)


def echo_json(value: Any) -> None:
    """One JSON document on stdout (datetimes as ISO 8601, enums as their value)."""
    click.echo(json.dumps(value, default=_json_default, sort_keys=True))


def when(value: dt.datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%SZ")


def echo_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@click.group(name="sched", cls=SchedGroup)
def sched() -> None:
    """celery_sched (the PostgreSQL scheduler): inspect and steer jobs and schedules."""
