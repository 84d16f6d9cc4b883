"""``celery beat --metrics-port N``: an option on Celery's own beat command.

A drop-in user registers nothing with their app, so this option cannot come
from ``app.user_options['beat']``. Celery imports the ``celery.commands``
entry points (this package) while it builds its command line, before it
parses the arguments; adding the option to Celery's ``beat`` command then
needs nothing from the user's app. The value goes to
:data:`celery_sched.beat.COMMAND_LINE`, which the scheduler reads with the
precedence of an argument, over the app's configuration and the environment.
Celery's ``Beat`` ignores keyword arguments it does not know, and this option
passes none (``expose_value=False``).
"""

from __future__ import annotations

from typing import Any

import click
from celery.bin.beat import beat as celery_beat

OPTION = "--metrics-port"


def _remember(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None:
        from celery_sched.beat import COMMAND_LINE

        COMMAND_LINE["metrics_port"] = value
    return value


def install() -> None:
    """Add ``--metrics-port`` to Celery's ``beat`` command, once."""
    if any(OPTION in getattr(param, "opts", ()) for param in celery_beat.params):
        return
    option: Any = click.Option(
        [OPTION],
        type=click.IntRange(0, 65535),
        default=None,
        expose_value=False,
        callback=_remember,
        help="celery_sched (-S celery_sched) only: serve /metrics, /healthz and /readyz on "
        "this TCP port (0: none); overrides celery_sched_metrics_port.",
    )
    celery_beat.params.append(option)
