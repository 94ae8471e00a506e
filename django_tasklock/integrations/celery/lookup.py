"""Celery's registry of tasks, as the ``tasklock`` command looks tasks up by
name. Celery is imported only when asked, and its absence is no error."""

from __future__ import annotations

from typing import Any

__all__ = ["registered_task", "registered_tasks"]


def registered_task(name: str) -> Any:
    """The task the current Celery app registers as ``name`` (the project's
    autodiscovered tasks loaded first); None if none, or no Celery."""
    try:
        from celery import current_app
    except ImportError:  # Celery is optional
        return None
    current_app.loader.import_default_modules()
    return current_app.tasks.get(name)


def registered_tasks() -> list[tuple[str, Any]]:
    """Every task of the current Celery app, by name; none without Celery."""
    try:
        from celery import current_app
    except ImportError:
        return []
    return sorted(current_app.tasks.items())
