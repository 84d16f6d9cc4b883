"""Steering periodic schedules: pause, resume, trigger, delete, history.

Every command that takes several names checks them all before it changes
anything: an unknown name (or a schedule defined in code, for ``delete``)
is a one-line error and nothing is written.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from celery_sched.cli.base import clean_errors, client_of, echo_json, echo_table, sched, when
from celery_sched.client import Client
from celery_sched.errors import UnknownSchedule
from celery_sched.models import Job, ScheduleInfo


def _existing(client: Client, names: Sequence[str]) -> list[ScheduleInfo]:
    """The schedules called ``names``, or UnknownSchedule for the first unknown."""
    infos: list[ScheduleInfo] = []
    for name in dict.fromkeys(names):
        info = client.schedules.get(name)
        if info is None:
            raise UnknownSchedule(name=name)
        infos.append(info)
    return infos


@sched.command()
@click.argument("names", nargs=-1, required=True)
@click.pass_context
def pause(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Pause schedules: the planner stops planning them, and their
    occurrences not yet due are withdrawn. Schedules defined in code can be
    paused too."""
    client = client_of(ctx)
    with clean_errors(), client:
        for info in _existing(client, names):
            client.schedules.pause(info.name)
            click.echo(f"Paused {info.name}.")


@sched.command()
@click.argument("names", nargs=-1, required=True)
@click.pass_context
def resume(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Resume schedules (and retry broken ones). What they missed while
    paused follows their misfire policy."""
    client = client_of(ctx)
    with clean_errors(), client:
        for info in _existing(client, names):
            resumed = client.schedules.resume(info.name)
            click.echo(f"Resumed {info.name}; next run {when(resumed.next_run_at)}.")


@sched.command()
@click.argument("name")
@click.pass_context
def trigger(ctx: click.Context, name: str) -> None:
    """Run one extra occurrence of a schedule now; print its job key.

    A schedule whose overlap policy is ``skip`` is not triggered while an
    occurrence of it is due or running (exit status 1).
    """
    client = client_of(ctx)
    with clean_errors(), client:
        _existing(client, [name])
        job = client.schedules.trigger(name)
    if job is None:
        raise click.ClickException(
            f"schedule {name!r} was not triggered: its overlap policy is skip and an "
            "occurrence of it is due or running"
        )
    click.echo(job.key)


@sched.command()
@click.argument("names", nargs=-1, required=True)
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_context
def delete(ctx: click.Context, names: tuple[str, ...], yes: bool) -> None:
    """Delete schedules. Their occurrences not yet due are withdrawn; those
    already due or sent, and the finished history, stay.

    A schedule defined in code (beat_schedule, a task decorator) is removed
    from the code, not here; once gone from it (disabled) it can be deleted.
    """
    client = client_of(ctx)
    with clean_errors(), client:
        infos = _existing(client, names)
        for info in infos:
            if info.source == "static" and info.enabled:
                # The manager refuses it before writing anything, in its own
                # words (the same refusal as Client.schedules.delete).
                client.schedules.delete(info.name)
        listed = ", ".join(info.name for info in infos)
        if not yes:
            click.confirm(f"Delete {len(infos)} schedule(s): {listed}?", abort=True)
        for info in infos:
            client.schedules.delete(info.name)
            click.echo(f"Deleted {info.name}.")


@sched.command()
@click.argument("name")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Show this many occurrences.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON array instead of a table.")
@click.pass_context
def history(ctx: click.Context, name: str, limit: int, as_json: bool) -> None:
    """The last occurrences of a schedule, newest first: when each was due,
    sent, started and finished, its status, and its lag (sent - due).

    Occurrences due by now are shown, triggered ones included; those
    planned ahead are not. Only occurrences not yet pruned are kept.
    """
    client = client_of(ctx)
    with clean_errors(), client:
        jobs = client.schedules.history(name, limit=limit)
    if as_json:
        echo_json([_history_row(job) for job in jobs])
        return
    if not jobs:
        click.echo(f"No occurrence of {name} is due yet (or all were pruned).")
        return
    header = ("due (UTC)", "sent", "started", "finished", "status", "lag")
    echo_table(
        header,
        [
            (
                when(job.due_at),
                when(job.dispatched_at),
                when(job.started_at),
                when(job.finished_at),
                job.status.value,
                _lag_text(job),
            )
            for job in jobs
        ],
    )


def _lag(job: Job) -> float | None:
    if job.dispatched_at is None:
        return None
    return (job.dispatched_at - job.due_at).total_seconds()


def _lag_text(job: Job) -> str:
    lag = _lag(job)
    return "-" if lag is None else f"{lag:.3f}s"


def _history_row(job: Job) -> dict[str, object]:
    return {
        "key": job.key,
        "id": str(job.id),
        "status": job.status.value,
        "due_at": job.due_at,
        "dispatched_at": job.dispatched_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "lag_seconds": _lag(job),
        "attempt": job.attempt,
        "worker": job.worker,
        "last_error": job.last_error,
    }
