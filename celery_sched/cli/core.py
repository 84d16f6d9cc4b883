"""The housekeeping commands: migrate, status, schedules, prune, reconcile."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import click

from celery_sched.cli.base import clean_errors, client_of, echo_json, sched
from celery_sched.cli.progress import on_terminal, progress_bar
from celery_sched.errors import StaleEpoch
from celery_sched.leader.reconciler import REQUEUE_BATCHES, Reconciler
from celery_sched.leader.stats import EngineStats
from celery_sched.models import JobStatus


@sched.command()
@click.pass_context
def migrate(ctx: click.Context) -> None:
    """Create or upgrade the celery_sched schema."""
    client = client_of(ctx)
    settings = client.settings
    with clean_errors(), client:
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
    client = client_of(ctx)
    with clean_errors(), client:
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
@click.option("--limit", type=click.IntRange(min=1), default=None, help="Show at most this many.")
@click.option("--after", default=None, help="Only schedules named after this (paging).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One JSON array: every field of each schedule, and its state.",
)
@click.pass_context
def schedules(ctx: click.Context, limit: int | None, after: str | None, as_json: bool) -> None:
    """List periodic schedules: name, kind, next run, last run, state.

    The state is active, paused, disabled (gone from the code), finished or
    broken; each broken schedule's reason follows the table.
    """
    client = client_of(ctx)
    with clean_errors(), client:
        infos = client.schedules.list(after=after, limit=limit)
        counts = {} if as_json else client.schedules.counts()
    if as_json:
        echo_json([{**dataclasses.asdict(info), "state": info.state} for info in infos])
        return
    if not infos:
        click.echo("No periodic schedules.")
        return

    def when(value: Any) -> str:
        return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%SZ")

    rows = [
        (
            info.name,
            info.kind,
            when(info.next_run_at),
            when(info.last_run_at)
            + (f" ({info.last_status.value})" if info.last_status is not None else ""),
            info.state + (" (code)" if info.source == "static" else ""),
        )
        for info in infos
    ]
    header = ("name", "kind", "next run (UTC)", "last run (UTC)", "state")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    broken = [info for info in infos if info.state == "broken"]
    if broken:
        click.echo(
            "Broken (the planner set them aside, or their arguments cannot be read here; "
            "update or resume one to retry it):"
        )
        for info in broken:
            click.echo(f"  {info.name}  since {when(info.broken_at)}: {info.broken_reason}")
    total = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    click.echo(f"{len(infos)} shown; stored: {total or 'none'}.")


@sched.command()
@click.option(
    "--older-than",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds since a job finished (default: celery_sched_retention).",
)
@click.option(
    "--ledger-older-than",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds since an idempotency-ledger entry completed "
    "(default: celery_sched_ledger_retention).",
)
@click.pass_context
def prune(ctx: click.Context, older_than: float | None, ledger_older_than: float | None) -> None:
    """Delete finished jobs and completed idempotency-ledger entries older than the retention.

    Deletes celery_sched_prune_batch rows per transaction until none is
    left; on a terminal a progress bar counts the rows and batches.
    """
    from celery_sched.backends import build_ledger

    client = client_of(ctx)
    settings = client.settings
    if older_than is None and settings.retention > 0:
        older_than = settings.retention
    if ledger_older_than is None and settings.ledger_retention > 0:
        ledger_older_than = settings.ledger_retention
    with clean_errors(), client:
        if older_than is None:
            click.echo("celery_sched_retention is 0: finished jobs are kept; nothing pruned.")
        else:
            job_horizon = older_than
            deleted = _in_batches(
                "Pruning jobs",
                lambda: client.store.prune(
                    older_than=job_horizon, batch=settings.prune_batch, max_batches=1
                ),
                settings.prune_batch,
            )
            click.echo(f"Pruned {deleted} finished job(s) older than {older_than:g}s.")
        if ledger_older_than is None:
            click.echo(
                "celery_sched_ledger_retention is 0: ledger entries are kept; nothing pruned."
            )
        else:
            ledger = build_ledger(settings, client.store)
            ledger_horizon = ledger_older_than
            try:
                entries = _in_batches(
                    "Pruning ledger",
                    lambda: ledger.prune(
                        older_than=ledger_horizon, batch=settings.prune_batch, max_batches=1
                    ),
                    settings.prune_batch,
                )
            finally:
                ledger.close()
            click.echo(
                f"Pruned {entries} idempotency-ledger entr{'y' if entries == 1 else 'ies'} "
                f"older than {ledger_older_than:g}s."
            )


def _in_batches(description: str, one_batch: Callable[[], int], batch: int) -> int:
    """Run ``one_batch`` (one transaction deleting up to ``batch`` rows) until
    a batch comes back short; return the total. A progress bar counts rows
    and batches on a terminal; elsewhere the caller's summary is all."""
    total = batches = 0
    with progress_bar(description, unit="row") as bar:
        while True:
            deleted = one_batch()
            total += deleted
            batches += 1
            bar.update(deleted)
            if on_terminal():
                bar.set_postfix(batches=batches)
            if deleted < batch:
                return total


@sched.command()
@click.option(
    "--shard",
    type=click.IntRange(min=0),
    default=None,
    help="The shard to reconcile (default: celery_sched_shard if pinned, else every shard).",
)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help=f"Jobs moved per transaction (default: {REQUEUE_BATCHES} x celery_sched_batch_size).",
)
@click.pass_context
def reconcile(ctx: click.Context, shard: int | None, limit: int | None) -> None:
    """Run the reconciler now, fenced by each shard's current leader epoch.

    Jobs dispatched longer ago than their visibility timeout, and running
    jobs past their max_runtime, go back to pending (attempt + 1), or become
    dead past max_attempts. The leader dispatches the requeued jobs again.
    Shards that never had a leader are skipped (nothing was dispatched).
    """
    client = client_of(ctx)
    settings = client.settings
    if shard is None:
        shards = list(range(settings.shards)) if settings.shard is None else [settings.shard]
    elif shard >= settings.shards:
        raise click.UsageError(f"--shard must be below celery_sched_shards ({settings.shards})")
    else:
        shards = [shard]
    with clean_errors(), client:
        led = [(one, client.store.current_epoch(one)) for one in shards]
        led = [(one, epoch) for one, epoch in led if epoch != 0]
        if not led:
            raise click.ClickException(
                f"{_shards_text(shards)}, so nothing was dispatched and "
                "there is nothing to reconcile; start a beat (its leader runs the reconciler too)"
            )
        for one, epoch in led:
            moved = EngineStats()
            reconciler = Reconciler(client.store, settings, moved, shard=one, limit=limit)
            try:
                reconciler.drain(epoch)
            except StaleEpoch as exc:
                raise click.ClickException(
                    f"StaleEpoch: {exc}. A new leader of shard {one} took over during the pass "
                    f"(after this command requeued {moved.requeued} and marked {moved.dead} "
                    "dead there); its reconciler carries on. Run the command again to "
                    "reconcile now."
                ) from exc
            click.echo(
                f"Shard {one} (epoch {epoch}): requeued {moved.requeued} job(s), marked "
                f"{moved.dead} dead; {moved.timed_out} of them were running past their "
                f"max_runtime; {moved.untracked} no worker tracks marked sent."
            )


def _shards_text(shards: list[int]) -> str:
    if len(shards) == 1:
        return f"shard {shards[0]} has never had a leader"
    return f"no shard of {shards[0]}..{shards[-1]} has ever had a leader"
