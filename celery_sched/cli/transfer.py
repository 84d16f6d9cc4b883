"""``sched import`` and ``sched export``: jobs and schedules in and out.

The readers and writers live in :mod:`celery_sched.transfer`; this module
parses options and prints.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import click

from celery_sched.cli.base import app_of, clean_errors, client_of, sched
from celery_sched.cli.progress import progress_bar
from celery_sched.errors import CelerySchedError, InvalidImport
from celery_sched.transfer import job_rows, schedule_file
from celery_sched.transfer.schedule_entries import Read, ScheduleImport, import_entries

#: Refusals listed one per line; past this, only their count.
SHOWN = 50

ORIGINS = ("file", "redbeat", "django-celery-beat")


@sched.command(name="import")
@click.argument("source", required=False, metavar="[FILE|-]")
@click.option(
    "--from",
    "origin",
    type=click.Choice(ORIGINS),
    default="file",
    show_default=True,
    help="Where to read: FILE (or - for stdin), celery-redbeat's Redis, "
    "or django-celery-beat's tables.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(job_rows.FORMATS),
    default=None,
    help="Format of FILE (default: by extension, .csv or .jsonl/.ndjson; needed for -).",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Valid job rows written per transaction.",
)
@click.option("--dry-run", is_flag=True, help="Validate and report; write nothing.")
@click.option(
    "--check-task/--no-check-task",
    default=True,
    show_default=True,
    help="Refuse tasks the Celery app does not register.",
)
@click.option(
    "--redis-url",
    default=None,
    help="--from redbeat: redbeat's Redis (default: the app's redbeat_redis_url, "
    "else its broker_url).",
)
@click.option(
    "--key-prefix",
    default=None,
    help="--from redbeat: redbeat's key prefix (default: the app's redbeat_key_prefix, "
    "else redbeat:).",
)
@click.option(
    "--database-url",
    default=None,
    help="--from django-celery-beat: the PostgreSQL URL of its tables.",
)
@click.option(
    "--db-schema",
    default="public",
    show_default=True,
    help="--from django-celery-beat: the PostgreSQL schema of its tables.",
)
@click.pass_context
def import_(
    ctx: click.Context,
    source: str | None,
    origin: str,
    fmt: str | None,
    chunk_size: int,
    dry_run: bool,
    check_task: bool,
    redis_url: str | None,
    key_prefix: str | None,
    database_url: str | None,
    db_schema: str,
) -> None:
    """Import one-off jobs, or periodic schedules, into celery_sched.

    \b
    FILE of jobs (CSV with a header row, or JSON lines; - for stdin): one job
    per row, with the fields Client.schedule_many takes: task, key, eta (or
    due, ISO 8601), countdown, args and kwargs (JSON in CSV), and options
    (queue, exchange, routing_key, priority, headers, expires, max_attempts,
    visibility_timeout, max_runtime, time_limit, soft_time_limit,
    ignore_result, compression). The rule: every row is validated on its
    own first; a bad row (malformed, unknown task, invalid time, a key
    given twice in the file) is refused and reported with its line number,
    and the other rows go on. Valid rows are written in chunks of
    --chunk-size, each chunk all or nothing: a chunk the store refuses (a
    key already stored) writes none of its rows and is reported with its
    lines. Run with --dry-run first to write nothing unless every row is
    valid.

    \b
    FILE written by `sched export` (JSON lines whose rows have a schedule
    object): periodic schedules. --from redbeat and --from
    django-celery-beat read periodic schedules from those schedulers. Each
    schedule is checked on its own; the bad ones, those whose name is
    stored already and those left out on purpose (disabled, defined in
    code) are skipped with the reason, and the others are added in one
    all-or-nothing transaction.

    Exit status 1 when a row was refused, a chunk not written or a schedule
    refused as invalid or unsupported; a missing or unreadable input is a
    one-line error and writes nothing.
    """
    app = app_of(ctx)
    if origin == "file":
        if source is None:
            raise click.UsageError(
                "give FILE (or - for stdin), or --from redbeat|django-celery-beat"
            )
    elif source is not None:
        raise click.UsageError(f"--from {origin} reads no FILE; drop {source!r}")
    if origin == "django-celery-beat" and database_url is None:
        raise click.UsageError("--from django-celery-beat needs --database-url")
    client = client_of(ctx)
    with clean_errors(), client:
        if origin == "redbeat":
            from celery_sched.transfer import redbeat

            url = redis_url or app.conf.get("redbeat_redis_url") or app.conf.broker_url
            if not url or not str(url).startswith(("redis://", "rediss://", "unix://")):
                raise click.UsageError("--from redbeat needs --redis-url redis://...")
            prefix = key_prefix or app.conf.get("redbeat_key_prefix") or redbeat.DEFAULT_PREFIX
            entries: Iterable[Read] = redbeat.read_entries(str(url), key_prefix=prefix, app=app)
            _import_schedules(client, entries, dry_run=dry_run, check_task=check_task)
            return
        if origin == "django-celery-beat":
            from celery_sched.transfer import django_celery_beat

            assert database_url is not None
            entries = django_celery_beat.read_entries(database_url, schema=db_schema, app=app)
            _import_schedules(client, entries, dry_run=dry_run, check_task=check_task)
            return
        assert source is not None
        with _opened(source) as stream:
            lines = iter(stream)
            first = _first_line(lines, source)
            rest = itertools.chain([first] if first else [], lines)
            if fmt != "csv" and first and schedule_file.is_schedule_row(first):
                entries = schedule_file.read_entries(rest, app=app)
                _import_schedules(client, entries, dry_run=dry_run, check_task=check_task)
                return
            fmt = job_rows.format_of(source, fmt)
            _import_jobs(client, job_rows.read_rows(rest, fmt), chunk_size, dry_run)


@contextlib.contextmanager
def _opened(source: str) -> Iterator[IO[str]]:
    if source == "-":
        yield io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", newline="")
        return
    try:
        stream = open(source, encoding="utf-8", newline="")  # noqa: SIM115
    except OSError as exc:
        raise InvalidImport(f"cannot open {source!r}: {exc.strerror or exc}") from None
    with stream:
        yield stream


def _first_line(lines: Iterator[str], source: str) -> str:
    try:
        return next(lines, "")
    except UnicodeDecodeError as exc:
        raise InvalidImport(f"{source!r} is not UTF-8 text: {exc.reason}") from None


def _import_jobs(
    client: Any, rows: Iterable[job_rows.Read], chunk_size: int, dry_run: bool
) -> None:
    report = job_rows.JobImport()
    bar = progress_bar("Importing jobs", unit="row")
    try:
        with bar:
            job_rows.import_rows(
                client,
                _decoded(rows),
                chunk_size=chunk_size,
                dry_run=dry_run,
                report=report,
                progress=bar.update,
            )
    except CelerySchedError:
        _job_summary(report, dry_run, interrupted=True)
        raise
    _job_summary(report, dry_run)
    if not report.ok:
        problems = [f"{len(report.refused)} row(s) refused"]
        if report.failed_chunks:
            problems.append(f"{len(report.failed_chunks)} chunk(s) not written")
        raise click.ClickException(f"{' and '.join(problems)}; see the lines above")


def _decoded(rows: Iterable[job_rows.Read]) -> Iterator[job_rows.Read]:
    """``rows``, with a file that stops being UTF-8 text a one-line error."""
    iterator = iter(rows)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except UnicodeDecodeError as exc:
            raise InvalidImport(f"the input is not UTF-8 text: {exc.reason}") from None
        yield row


def _job_summary(report: job_rows.JobImport, dry_run: bool, *, interrupted: bool = False) -> None:
    if dry_run:
        click.echo(
            f"Dry run: read {report.read} row(s): {report.valid} valid, "
            f"{len(report.refused)} refused; nothing written."
        )
    else:
        ended = " before the import stopped" if interrupted else ""
        click.echo(
            f"Read {report.read} row(s): {report.valid} valid, {report.written} written{ended}, "
            f"{len(report.refused)} refused."
        )
    if report.refused:
        click.echo("Refused rows:")
        for line, reason in report.refused[:SHOWN]:
            click.echo(f"  line {line}: {reason}")
        if len(report.refused) > SHOWN:
            click.echo(f"  ... and {len(report.refused) - SHOWN} more")
    if report.failed_chunks:
        click.echo("Chunks not written (each all or nothing):")
        for chunk in report.failed_chunks:
            click.echo(
                f"  lines {chunk.first_line}-{chunk.last_line} ({chunk.rows} row(s)): "
                f"{chunk.reason}"
            )


def _import_schedules(
    client: Any, entries: Iterable[Read], *, dry_run: bool, check_task: bool
) -> None:
    result = import_entries(client, entries, dry_run=dry_run, check_task=check_task)
    _schedule_summary(result, dry_run)
    if not result.ok:
        refused = sum(1 for skip in result.skipped if skip.refused)
        raise click.ClickException(
            f"{refused} schedule(s) refused as invalid or unsupported; see the lines above"
        )


def _schedule_summary(result: ScheduleImport, dry_run: bool) -> None:
    verb = "Would add" if dry_run else "Added"
    click.echo(f"{verb} {len(result.added)} schedule(s){':' if result.added else '.'}")
    for entry in result.added:
        fields = entry.fields
        paused = " (paused)" if entry.paused else ""
        click.echo(f"  {entry.name}: {fields['task']} on {fields['schedule']!r}{paused}")
    if result.skipped:
        click.echo(f"Skipped {len(result.skipped)}:")
        for skip in result.skipped:
            mark = "refused" if skip.refused else "left out"
            click.echo(f"  {skip.name} ({skip.where}), {mark}: {skip.reason}")
    if dry_run:
        click.echo("Dry run: nothing written.")


@sched.command(name="export")
@click.argument("target", required=False, default="-", metavar="[FILE|-]")
@click.pass_context
def export(ctx: click.Context, target: str) -> None:
    """Write every periodic schedule as JSON lines (to stdout by default),
    in the form `sched import` reads back.

    Arguments and options are written as JSON; a schedule whose arguments
    only its serializer can encode (pickle) fails the export, and nothing
    is written. A FILE is replaced only once the whole export succeeded.
    """
    client = client_of(ctx)
    with clean_errors(), client:
        try:
            lines = [schedule_file.dump_row(row) for row in schedule_file.export_rows(client)]
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
    text = "".join(line + "\n" for line in lines)
    if target == "-":
        click.echo(text, nl=False)
        return
    _write_atomically(Path(target), text)
    click.echo(f"Exported {len(lines)} schedule(s) to {target}.", err=True)


def _write_atomically(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file beside it, so a failed export
    never leaves it half written."""
    temporary: str | None = None
    try:
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, path)
    except OSError as exc:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise click.ClickException(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
