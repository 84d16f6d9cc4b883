from __future__ import annotations

from django.apps import AppConfig


class ParcelsConfig(AppConfig):
    name = "parcels"

    def ready(self) -> None:
        from parcels import signals  # noqa: F401  (connects the publish receivers)
