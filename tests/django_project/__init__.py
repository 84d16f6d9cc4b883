"""The smallest Django project that configures Celery the way Django's docs
say: ``tests/integration/test_settings_django.py`` runs it in a subprocess."""
