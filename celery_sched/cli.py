"""``celery -A proj sched ...``: schema migration, status and pruning.

Registered through the ``celery.commands`` entry point, so Celery loads the
app and hands it over as ``ctx.obj.app``. The only module that prints; every
celery_sched error becomes a one-line click error (exit status 1) that names
the problem, without a traceback and without a password.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import click

from celery_sched.client import Client
from celery_sched.errors import CelerySchedError
from celery_sched.models import JobStatus
from celery_sched.settings import Settings


@contextlib.contextmanager
def _clean_errors() -> Iterator[None]:
    try:
        yield
    except CelerySchedError as exc:
        raise click.ClickException(f"{type(exc).__name__}: {exc}") from exc
    except ValueError as exc:
        # Settings parsing can still surface a bare ValueError (a URL with a
        # non-numeric port); its message carries no password.
        raise click.ClickException(f"invalid celery_sched configuration: {exc}") from exc


def _app(ctx: click.Context) -> Any:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise click.UsageError("run as `celery -A proj sched ...` so the Celery app is known")
    return app


def _client(ctx: click.Context) -> Client:
    app = _app(ctx)
    with _clean_errors():
        return Client(app, settings=Settings.from_app(app))


@click.group(name="sched")
def sched() -> None:
    """celery_sched: the PostgreSQL-backed scheduler (migrate, status, prune)."""


@sched.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the celery_sched schema."""
    client = _client(ctx)
    settings = client.settings
    with _clean_errors(), client:
        click.echo(f"Migrating schema {settings.db_schema!r} at {settings.safe_database_url} ...")
        client.migrate()
    click.echo(f"Schema {settings.db_schema!r} is up to date.")


@sched.command()
@click.option("--by-hour", is_flag=True, help="Also show job counts per UTC hour of due time.")
@click.option(
    "--status",
    "status_filter",
    type=click.Choice([status.value for status in JobStatus]),
    default=None,
    help="With --by-hour: count only jobs in this status.",
)
@click.pass_context
def status(ctx: click.Context, by_hour: bool, status_filter: str | None) -> None:
    """Show how many jobs are in each status."""
    client = _client(ctx)
    with _clean_errors(), client:
        counts = client.counts_by_status()
        hours = (
            client.counts_by_hour(JobStatus(status_filter) if status_filter else None)
            if by_hour
            else {}
        )
    settings = client.settings
    click.echo(f"Schema {settings.db_schema!r} at {settings.safe_database_url}")
    width = max(len(s.value) for s in JobStatus)
    for job_status in JobStatus:
        click.echo(f"  {job_status.value:<{width}}  {counts.get(job_status, 0)}")
    click.echo(f"  {'total':<{width}}  {sum(counts.values())}")
    if by_hour:
        label = f"{status_filter} jobs" if status_filter else "jobs"
        click.echo(f"Due {label} per UTC hour:")
        if not hours:
            click.echo("  (none)")
        for hour in sorted(hours):
            click.echo(f"  {hour.strftime('%Y-%m-%dT%H:00Z')}  {hours[hour]}")


@sched.command()
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds since a job finished (default: celery_sched_retention).",
)
@click.pass_context
def prune(ctx: click.Context, older_than: float | None) -> None:
    """Delete finished jobs older than the retention."""
    client = _client(ctx)
    settings = client.settings
    if older_than is None:
        if settings.retention <= 0:
            click.echo("celery_sched_retention is 0: finished jobs are kept; nothing pruned.")
            return
        older_than = settings.retention
    with _clean_errors(), client:
        deleted = client.store.prune(older_than=older_than, batch=settings.prune_batch)
    click.echo(f"Pruned {deleted} finished job(s) older than {older_than:g}s.")
