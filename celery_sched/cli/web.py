"""``sched web``: serve the web console (:mod:`celery_sched.web`)."""

from __future__ import annotations

import click

from celery_sched.cli.base import clean_errors, client_of, sched
from celery_sched.errors import ConfigurationError


def _split_bind(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{bind!r} is not HOST:PORT (e.g. 127.0.0.1:8808)")
    return host.strip("[]"), int(port)


@sched.command()
@click.option(
    "--bind",
    default="127.0.0.1:8808",
    show_default=True,
    help="HOST:PORT to serve on. Beyond loopback it needs --auth (or --insecure).",
)
@click.option(
    "--auth",
    default=None,
    metavar="USER:PASSWORD",
    help="HTTP Basic credentials to ask for (default: celery_sched_web_auth).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Serve beyond loopback without auth: anyone who reaches it can steer jobs.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    # Celery's auto envvar prefix would read CELERY_SCHED_WEB_ALLOWED_HOSTS
    # here split on spaces; the setting reads that variable, commas and all.
    allow_from_autoenv=False,
    metavar="NAME[:PORT]",
    help="Also answer requests for this Host (repeatable; default: "
    "celery_sched_web_allowed_hosts). The loopback names and the bound address are "
    "always answered, any other Host gets 400.",
)
@click.pass_context
def web(
    ctx: click.Context,
    bind: str,
    auth: str | None,
    insecure: bool,
    allowed_hosts: tuple[str, ...],
) -> None:
    """Serve the web console: overview, schedules and jobs, over this app's settings."""
    try:
        import uvicorn

        from celery_sched.web.app import Credentials, check_bind, create_app
    except ImportError as exc:
        raise click.ClickException(
            f"the web console needs the 'web' extra: pip install 'celery_sched[web]' ({exc})"
        ) from exc
    host, port = _split_bind(bind)
    client = client_of(ctx)
    with clean_errors(), client:
        text = auth if auth is not None else client.settings.web_auth
        credentials = Credentials.parse(text) if text else None
        check_bind(host, auth=credentials, insecure=insecure)
        if insecure and credentials is None:
            click.echo("WARNING: serving the console without auth (--insecure)", err=True)
        hosts = allowed_hosts or client.settings.web_allowed_hosts
        app = create_app(client, auth=credentials, allowed_hosts=hosts, bind=host)
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"celery_sched web console on http://{shown}:{port}/", err=True)
        if host in ("0.0.0.0", "::") and not hosts:  # noqa: S104
            click.echo(
                "Only the loopback names are answered; give the names clients use "
                "with --allowed-host",
                err=True,
            )
        try:
            uvicorn.run(app, host=host, port=port, log_level="warning")
        except OSError as exc:  # the port is taken
            raise ConfigurationError(f"cannot serve on {bind}: {exc}") from exc
