from __future__ import annotations

import sys

from django.apps import AppConfig
from django.conf import settings as django_settings
from django.core import checks


class TaskLockConfig(AppConfig):
    name = "django_tasklock"
    verbose_name = "Task locks"

    def ready(self) -> None:
        from .checks import check_settings

        checks.register(check_settings, checks.Tags.caches)
        if "celery" in sys.modules:
            # A Celery process (a worker sets Django up after importing
            # Celery, before it sends worker_init): its workers check first.
            # Elsewhere Celery is not imported for this.
            from .integrations.celery.startup import connect

            connect()
        raw = getattr(django_settings, "TASKLOCK", None)
        if isinstance(raw, dict) and raw.get("METRICS") == "prometheus":
            try:
                from .metrics import install

                install()
            except ImportError:
                pass  # reported by the checks (E020), which say what to install
