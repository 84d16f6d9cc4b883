"""Moving jobs and schedules in and out of celery_sched (``sched import`` / ``export``).

One module per format, each a reader (or writer) that turns its input into
what :class:`~celery_sched.Client` takes, so the CLI only parses options
and prints:

- :mod:`~celery_sched.transfer.job_rows`: one-off jobs from CSV or JSON
  lines, validated row by row and written through ``Client.schedule_many``
  in chunks.
- :mod:`~celery_sched.transfer.schedule_file`: the JSON-lines form of the
  ``schedules`` table that ``sched export`` writes and ``sched import``
  reads back.
- :mod:`~celery_sched.transfer.redbeat`: celery-redbeat's entries, read
  from Redis.
- :mod:`~celery_sched.transfer.django_celery_beat`: django-celery-beat's
  tables, read with SQL (no Django needed).
- :mod:`~celery_sched.transfer.schedule_entries`: what the schedule readers
  share: an entry, a skipped entry with its reason, and the import itself
  (``Client.schedules.add_many``).
"""

from __future__ import annotations
