"""The job commands: jobs, job, dead, requeue, cancel, leader.

They only parse options and print: the reads and the changes are
:class:`~celery_sched.client.Client` methods, which the web console calls
too. Listings page by keyset (``--after`` takes the cursor a page printed);
``--json`` prints one JSON document. Times given on the command line are
ISO 8601; one without an offset is taken as UTC.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

import click

from celery_sched.cli.base import clean_errors, client_of, echo_json, echo_table, sched, when
from celery_sched.client import Client
from celery_sched.models import REQUEUABLE_STATUSES, JobPage, JobQuery, JobStatus
from celery_sched.models.listing import job_fields

#: Jobs per page unless ``--limit`` says otherwise, and the most it may say.
DEFAULT_LIMIT = 50
MAX_LIMIT = 10_000

_STATUSES = [status.value for status in JobStatus]
_REQUEUABLE = " or ".join(sorted(status.value for status in REQUEUABLE_STATUSES))


class IsoTime(click.ParamType[dt.datetime]):
    """An ISO 8601 date or time; without an offset it is UTC."""

    name = "ISO-8601"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> dt.datetime:
        if isinstance(value, dt.datetime):
            return value
        try:
            parsed = dt.datetime.fromisoformat(str(value).strip())
        except ValueError:
            self.fail(f"{value!r} is not an ISO 8601 time (e.g. 2031-05-01T10:00:00Z)", param, ctx)
        if parsed.tzinfo is None:
            return parsed.replace(tzinfo=dt.UTC)
        return parsed.astimezone(dt.UTC)


ISO_TIME = IsoTime()


def _print_page(page: JobPage, *, as_json: bool, empty: str) -> None:
    cursor = None if page.next is None else page.next.encode()
    if as_json:
        echo_json({"jobs": [job_fields(job) for job in page.jobs], "next": cursor})
        return
    if not page.jobs:
        click.echo(empty)
        return
    echo_table(
        ("key", "task", "status", "due (UTC)", "attempt", "shard"),
        [
            (
                job.key,
                job.task,
                job.status.value,
                when(job.due_at),
                f"{job.attempt}/{job.max_attempts}",
                str(job.shard),
            )
            for job in page.jobs
        ],
    )
    if cursor is None:
        click.echo(f"{len(page.jobs)} shown; last page.")
    else:
        click.echo(f"{len(page.jobs)} shown; next page: --after {cursor}")


_limit_option = click.option(
    "--limit",
    type=click.IntRange(1, MAX_LIMIT),
    default=DEFAULT_LIMIT,
    show_default=True,
    help="Jobs per page.",
)
_after_option = click.option(
    "--after", "cursor", default=None, metavar="CURSOR", help="The page after this cursor."
)
_json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


@sched.command()
@click.option(
    "--status",
    "statuses",
    multiple=True,
    type=click.Choice(_STATUSES),
    help="Only jobs in this status (repeatable).",
)
@click.option("--task", default=None, help="Only jobs of this task name.")
@click.option("--key-prefix", default=None, help="Only jobs whose key starts with this.")
@click.option("--due-after", type=ISO_TIME, default=None, help="Due at or after (ISO 8601).")
@click.option("--due-before", type=ISO_TIME, default=None, help="Due before (ISO 8601).")
@click.option("--newest", is_flag=True, help="Latest due first (default: soonest first).")
@_limit_option
@_after_option
@_json_option
@click.pass_context
def jobs(
    ctx: click.Context,
    statuses: Sequence[str],
    task: str | None,
    key_prefix: str | None,
    due_after: dt.datetime | None,
    due_before: dt.datetime | None,
    newest: bool,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List jobs, a page at a time, by due time (UTC; naive times are UTC)."""
    if due_after is not None and due_before is not None and due_after >= due_before:
        raise click.UsageError("--due-after must be earlier than --due-before")
    query = JobQuery(
        statuses=frozenset(JobStatus(status) for status in statuses),
        task=task,
        key_prefix=key_prefix,
        due_after=due_after,
        due_before=due_before,
        newest=newest,
    )
    client = client_of(ctx)
    with clean_errors(), client:
        page = client.list_jobs(query, after=cursor, limit=limit)
    _print_page(page, as_json=as_json, empty="No jobs.")


@sched.command()
@click.option("--task", default=None, help="Only dead jobs of this task name.")
@click.option("--newest", is_flag=True, help="Latest due first (default: soonest first).")
@_limit_option
@_after_option
@_json_option
@click.pass_context
def dead(
    ctx: click.Context,
    task: str | None,
    newest: bool,
    limit: int,
    cursor: str | None,
    as_json: bool,
) -> None:
    """List dead jobs (given up after max_attempts), as `jobs --status dead`."""
    query = JobQuery(statuses=frozenset({JobStatus.DEAD}), task=task, newest=newest)
    client = client_of(ctx)
    with clean_errors(), client:
        page = client.list_jobs(query, after=cursor, limit=limit)
    _print_page(page, as_json=as_json, empty="No dead jobs.")


@sched.command()
@click.argument("key")
@_json_option
@click.pass_context
def job(ctx: click.Context, key: str, as_json: bool) -> None:
    """Show one job: every field, its arguments and the headers it is sent with."""
    client = client_of(ctx)
    with clean_errors(), client:
        found = client.get(key)
        if found is None:
            raise click.ClickException(f"no job with key {key!r}")
        headers = client.message_headers(found)
        fields = job_fields(found)
        try:
            args, kwargs = client.decode(found)
            fields["args"], fields["kwargs"] = list(args), kwargs
        except (ValueError, TypeError) as exc:
            # An untrusted or corrupt body is shown as why, never unpickled.
            fields["args"] = fields["kwargs"] = None
            fields["body_error"] = str(exc)
    fields["headers"] = headers
    if as_json:
        echo_json(fields)
        return
    width = max(len(name) for name in fields)
    for name, value in fields.items():
        if name == "headers":
            continue
        click.echo(f"{name:<{width}}  {_shown(value)}")
    click.echo("headers (as the shard's current leader would send them now):")
    for name in sorted(headers):
        click.echo(f"  {name}: {_shown(headers[name])}")


def _shown(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)


@sched.command()
@click.argument("keys", nargs=-1)
@click.option("--all-dead", is_flag=True, help="Requeue every dead job, a batch at a time.")
@click.option("--task", default=None, help="With --all-dead: only dead jobs of this task.")
@click.option(
    "--attempts",
    type=click.IntRange(min=1),
    default=None,
    help="Attempts each requeued job is allowed from its new one (default: its max_attempts).",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=None,
    help="With --all-dead: jobs per transaction (default: celery_sched_batch_size).",
)
@_json_option
@click.pass_context
def requeue(
    ctx: click.Context,
    keys: Sequence[str],
    all_dead: bool,
    task: str | None,
    attempts: int | None,
    batch: int | None,
    as_json: bool,
) -> None:
    """Run dead or failed jobs again: pending, due now, at their next attempt.

    The attempt count goes on (a late message of an older attempt stays
    fenced) and the job may be tried --attempts more times (default its
    max_attempts). Any other job is left as it is and reported.
    """
    if all_dead == bool(keys):
        raise click.UsageError("give job keys or --all-dead (one of them)")
    if task is not None and not all_dead:
        raise click.UsageError("--task goes with --all-dead")
    if batch is not None and not all_dead:
        raise click.UsageError("--batch goes with --all-dead")
    client = client_of(ctx)
    with clean_errors(), client:
        if all_dead:
            _requeue_all_dead(client, task=task, attempts=attempts, batch=batch, as_json=as_json)
            return
        result = client.requeue(keys, allowance=attempts)
    if as_json:
        echo_json(
            {
                "requeued": [
                    {"key": job.key, "attempt": job.attempt, "max_attempts": job.max_attempts}
                    for job in result.requeued
                ],
                "refused": {key: status.value for key, status in result.refused.items()},
                "unknown": result.unknown,
            }
        )
    else:
        for moved in result.requeued:
            click.echo(
                f"requeued {moved.key}: attempt {moved.attempt}, max_attempts {moved.max_attempts}"
            )
        for key, status in result.refused.items():
            click.echo(f"not requeued {key}: it is {status.value} (only {_REQUEUABLE} jobs are)")
        for key in result.unknown:
            click.echo(f"unknown {key}: no job has this key")
        click.echo(f"Requeued {len(result.requeued)} job(s).")
    if result.unknown:
        raise click.ClickException(f"{len(result.unknown)} unknown key(s): {result.unknown[0]!r}")


def _requeue_all_dead(
    client: Client, *, task: str | None, attempts: int | None, batch: int | None, as_json: bool
) -> None:
    def progress(total: int) -> None:
        if not as_json:
            click.echo(f"  ... {total} requeued", err=True)

    total = client.requeue_dead(task=task, allowance=attempts, batch=batch, progress=progress)
    if as_json:
        echo_json({"requeued": total, "task": task})
    else:
        what = "dead job(s)" if task is None else f"dead job(s) of {task}"
        click.echo(f"Requeued {total} {what}.")


@sched.command()
@click.argument("keys", nargs=-1, required=True)
@_json_option
@click.pass_context
def cancel(ctx: click.Context, keys: Sequence[str], as_json: bool) -> None:
    """Cancel pending jobs; exits 1 if a key is unknown."""
    cancelled: list[str] = []
    refused: dict[str, str] = {}
    unknown: list[str] = []
    client = client_of(ctx)
    with clean_errors(), client:
        for key in dict.fromkeys(keys):
            if client.cancel(key):
                cancelled.append(key)
                continue
            found = client.get(key)
            if found is None:
                unknown.append(key)
            else:
                refused[key] = found.status.value
    if as_json:
        echo_json({"cancelled": cancelled, "not_cancellable": refused, "unknown": unknown})
    else:
        for key in cancelled:
            click.echo(f"cancelled {key}")
        for key, status in refused.items():
            click.echo(f"not cancelled {key}: it is {status}, only pending jobs are")
        for key in unknown:
            click.echo(f"unknown {key}: no job has this key")
    if unknown:
        raise click.ClickException(f"{len(unknown)} unknown key(s): {unknown[0]!r}")


@sched.command()
@_json_option
@click.pass_context
def leader(ctx: click.Context, as_json: bool) -> None:
    """Per shard: the leader (host:pid), its epoch, the lease's time left and its last pass."""
    client = client_of(ctx)
    with clean_errors(), client:
        epochs = client.epochs()
        now = client.store.now()
        views = client.leaders()
    rows: list[dict[str, Any]] = []
    for view in views:
        report = view.report
        rows.append(
            {
                "shard": view.shard,
                "leader": view.holder,
                "epoch": epochs.get(view.shard, 0),
                "lease_ttl": view.ttl,
                "last_pass_at": None if report is None else report.pass_at,
                "last_pass_ago": (
                    None if report is None else max(0.0, (now - report.pass_at).total_seconds())
                ),
                "last_pass_by": None if report is None else f"{report.host}:{report.pid}",
                "last_pass_epoch": None if report is None else report.epoch,
            }
        )
    if as_json:
        echo_json({"shards": rows})
        return
    echo_table(
        ("shard", "leader", "epoch", "lease left", "last pass (UTC)", "ago", "by"),
        [
            (
                str(row["shard"]),
                row["leader"] or "- (none)",
                str(row["epoch"]),
                "-" if row["lease_ttl"] is None else f"{row['lease_ttl']:.1f}s",
                when(row["last_pass_at"]),
                "-" if row["last_pass_ago"] is None else f"{row['last_pass_ago']:.1f}s",
                "-"
                if row["last_pass_by"] is None
                else f"{row['last_pass_by']} (epoch {row['last_pass_epoch']})",
            )
            for row in rows
        ],
    )
