"""The one table of the caches that can hold locks, and of those that cannot.

The backend lookup (``backend_for``), the system checks, the error messages and
the docs' table of supported caches all read ``SUPPORTED``: the rows each
store package declares (its ``SUPPORTED``), gathered here. A new store is a
package under ``backends/`` and its name in that line.
"""

from __future__ import annotations

from typing import Any, Final

from django.core.cache.backends.db import DatabaseCache
from django.core.cache.backends.dummy import DummyCache
from django.core.cache.backends.filebased import FileBasedCache
from django.core.cache.backends.memcached import BaseMemcachedCache
from django.utils.module_loading import import_string

from . import locmem, memcached, postgres, redis
from .base import Supported

__all__ = [
    "SUPPORTED",
    "UNSUPPORTED",
    "Supported",
    "cache_class",
    "recommended_paths",
    "supported_for",
    "supported_names",
]


#: Every store package's rows, in the order a cache class is matched (a
#: subclass's row before its base's) and the docs list them.
SUPPORTED: Final = (
    *memcached.SUPPORTED,
    *redis.SUPPORTED,
    *postgres.SUPPORTED,
    *locmem.SUPPORTED,
)

#: Caches that cannot hold locks, and why.
UNSUPPORTED: Final[tuple[tuple[type[Any], str], ...]] = (
    (
        DummyCache,
        "DummyCache stores nothing and its add() always succeeds, so every "
        "caller would hold the lock at once",
    ),
    (
        FileBasedCache,
        "FileBasedCache.add() checks for the file and then writes it, "
        "so two processes can both take the lock",
    ),
    (
        DatabaseCache,
        "DatabaseCache.add() takes over an expired row with a SELECT "
        "and then an UPDATE, so two processes can both take the lock; on "
        "PostgreSQL, use django_tasklock.backends.postgres.cache.PostgresCache",
    ),
    (
        BaseMemcachedCache,
        "django_tasklock talks to memcached through pymemcache or pylibmc only",
    ),
)


def cache_class(entry: Supported) -> type[Any] | None:
    """The cache class of ``entry``; None if its package is not installed."""
    try:
        found: type[Any] = import_string(entry.path)
    except ImportError:
        return None
    return found


def supported_for(backend_class: type[Any]) -> Supported | None:
    """The entry of a cache class (or of a class it derives from), if any."""
    for entry in SUPPORTED:
        found = cache_class(entry)
        if found is not None and issubclass(backend_class, found):
            return entry
    return None


def supported_names() -> str:
    """The supported caches, for messages."""
    names = [entry.name for entry in SUPPORTED]
    return ", ".join(names[:-1]) + " or " + names[-1]


def recommended_paths() -> str:
    """The dotted paths of the caches to point locks at, for hints."""
    paths = [entry.path for entry in SUPPORTED if entry.recommended]
    return ", ".join(paths[:-1]) + " or " + paths[-1]
