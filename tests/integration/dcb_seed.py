"""Create django-celery-beat's tables with its own Django migrations, and
periodic tasks through its models: ``python -m tests.integration.dcb_seed``
with ``DCB_URL`` and ``DCB_SCHEMA`` set (the schema must exist)."""

from __future__ import annotations

import datetime as dt
import json
import os

os.environ["DJANGO_SETTINGS_MODULE"] = "tests.integration.dcb_settings"

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django_celery_beat.models import (  # noqa: E402
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    SolarSchedule,
)


def main() -> None:
    call_command("migrate", "django_celery_beat", verbosity=0)
    nightly = CrontabSchedule.objects.create(
        minute="30", hour="2", day_of_week="1-5", timezone="Europe/Paris"
    )
    PeriodicTask.objects.create(
        name="nightly",
        task="cli_app.ping",
        crontab=nightly,
        args=json.dumps([1, "two"]),
        kwargs=json.dumps({"three": 3}),
        queue="reports",
        priority=7,
        headers=json.dumps({"source": "dcb"}),
        expire_seconds=120,
    )
    every = IntervalSchedule.objects.create(every=90, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="every-90s", task="cli_app.ping", interval=every)
    PeriodicTask.objects.create(
        name="switched-off", task="cli_app.ping", interval=every, enabled=False
    )
    dawn = SolarSchedule.objects.create(event="sunrise", latitude=48.85, longitude=2.35)
    PeriodicTask.objects.create(name="at-dawn", task="cli_app.ping", solar=dawn)
    once = ClockedSchedule.objects.create(
        clocked_time=dt.datetime(2031, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    )
    PeriodicTask.objects.create(name="once", task="cli_app.ping", clocked=once, one_off=True)
    PeriodicTask.objects.create(
        name="once-a-minute-once", task="cli_app.ping", interval=every, one_off=True
    )
    PeriodicTask.objects.create(name="not-registered", task="no.such.task", interval=every)
    bad = CrontabSchedule.objects.create(minute="61", hour="*", timezone="UTC")
    PeriodicTask.objects.create(name="bad-minute", task="cli_app.ping", crontab=bad)


if __name__ == "__main__":
    main()
