"""What the decorated tasks of this process name, for the system checks."""

from __future__ import annotations

import threading

__all__ = ["name_alias", "named_aliases"]

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
