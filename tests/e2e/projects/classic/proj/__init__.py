"""A Celery project configured the classic way: an upper-case settings module."""

from proj.celery import app as celery_app

__all__ = ["celery_app"]
