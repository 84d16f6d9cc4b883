"""The Django project; its Celery app is loaded with Django, as Celery's docs say."""

from shop.celery import app as celery_app

__all__ = ["celery_app"]
