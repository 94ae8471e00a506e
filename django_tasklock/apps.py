from __future__ import annotations

from django.apps import AppConfig
from django.core import checks


class TaskLockConfig(AppConfig):
    name = "django_tasklock"
    verbose_name = "Task locks"

    def ready(self) -> None:
        from .checks import check_settings

        checks.register(check_settings, checks.Tags.caches)
