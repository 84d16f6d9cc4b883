"""``python -m celery_sched ...``: the commands that need no Celery app.

Today that is ``dev``, the PostgreSQL and Redis of :mod:`celery_sched.dev`,
so that a machine with only Python can try celery_sched before any project
(and its ``celery -A proj``) exists. ``celery -A proj sched dev`` is the same
command.
"""

from __future__ import annotations

import click

from celery_sched.cli.dev import dev


@click.group()
def main() -> None:
    """celery_sched commands that need no Celery app (see `celery -A proj sched` for the rest)."""


main.add_command(dev)

if __name__ == "__main__":
    main(prog_name="python -m celery_sched")
