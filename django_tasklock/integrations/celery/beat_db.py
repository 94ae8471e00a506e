"""django-celery-beat's ``DatabaseScheduler``, one of several beats (see
``beat``): ``celery -A proj beat -S
django_tasklock.integrations.celery.beat_db:LeaderDatabaseScheduler``. Needs
django-celery-beat (the ``beat`` extra) in ``INSTALLED_APPS``."""

from __future__ import annotations

from django_celery_beat.schedulers import (  # type: ignore[import-untyped]
    DatabaseScheduler,
)

from .beat import LeaderMixin

__all__ = ["LeaderDatabaseScheduler"]


class LeaderDatabaseScheduler(LeaderMixin, DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's ``DatabaseScheduler``, one of several."""
