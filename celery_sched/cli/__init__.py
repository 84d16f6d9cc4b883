"""``celery -A proj sched ...``: the command line of celery_sched.

Registered through the ``celery.commands`` entry point, so Celery loads the
app and hands it over as ``ctx.obj.app``. One module per family of commands,
each adding its commands to :data:`sched`; these modules are the only ones in
the package that print.
"""

from celery_sched.cli import (  # noqa: F401  (they register commands)
    beat_options,
    core,
    dev,
    jobs,
    reshard,
    schedules,
    transfer,
    web,
)
from celery_sched.cli.base import sched

beat_options.install()

__all__ = ["sched"]
