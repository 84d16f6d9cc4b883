"""Django settings of the django-celery-beat import test
(``tests/integration/test_cli_transfer.py``): django_celery_beat's tables in
the PostgreSQL schema named by ``DCB_SCHEMA``, in the database of ``DCB_URL``."""

from __future__ import annotations

import os
import urllib.parse

_url = urllib.parse.urlsplit(os.environ["DCB_URL"].replace("+psycopg", ""))

SECRET_KEY = "celery-sched-tests-only"
INSTALLED_APPS = ["django_celery_beat"]
USE_TZ = True
TIME_ZONE = "UTC"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": _url.username or "postgres",
        "PASSWORD": _url.password or "",
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": str(_url.port or 5432),
        "OPTIONS": {"options": f"-c search_path={os.environ['DCB_SCHEMA']}"},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
