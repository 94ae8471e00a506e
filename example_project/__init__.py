"""The Celery cookbook's djangofeeds importer, built for real on django_tasklock."""

from __future__ import annotations

from .celery import app as celery_app

__all__ = ["celery_app"]
