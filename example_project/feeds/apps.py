from __future__ import annotations

from django.apps import AppConfig
from django.db.backends.signals import connection_created


def _sqlite_wal(sender: object, connection: object, **kwargs: object) -> None:
    # Readers do not block the writer (several worker processes share the file).
    if getattr(connection, "vendor", "") == "sqlite":
        with connection.cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute("PRAGMA journal_mode=WAL")


class FeedsConfig(AppConfig):
    name = "example_project.feeds"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        connection_created.connect(_sqlite_wal)
        from . import signals  # noqa: F401  (records each task's outcome)
