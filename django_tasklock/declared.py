"""What the decorated tasks of this process name, for the system checks, and
the import of the installed apps' task modules that declares them."""

from __future__ import annotations

import threading

__all__ = ["import_task_modules", "name_alias", "named_aliases"]

_aliases: dict[str, set[str]] = {}
_mutex = threading.Lock()


def name_alias(alias: str, user: str) -> None:
    """Record that ``user`` (a task's dotted name) takes its locks on ``alias``."""
    with _mutex:
        _aliases.setdefault(alias, set()).add(user)


def named_aliases() -> dict[str, set[str]]:
    """Every CACHES alias a ``@single_instance(cache=...)`` named so far, with the
    functions that name it."""
    with _mutex:
        return {alias: set(users) for alias, users in _aliases.items()}


def import_task_modules() -> list[tuple[str, Exception]]:
    """Import each installed app's ``tasks`` module, as Celery's autodiscovery
    does, so that the tasks and limits it declares are known (to the checks,
    the console, the ``tasklock`` command); the modules that would not import,
    with why."""
    from importlib import import_module
    from importlib.util import find_spec

    from django.apps import apps

    failed: list[tuple[str, Exception]] = []
    for config in apps.get_app_configs():
        name = f"{config.name}.tasks"
        try:
            if find_spec(name) is None:
                continue
            import_module(name)
        except Exception as exc:
            failed.append((name, exc))
    return failed
