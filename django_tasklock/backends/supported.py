"""The one table of the caches that can hold locks, and of those that cannot.

The backend lookup (``backend_for``), the system checks, the error messages and
the docs' table of supported caches all read ``SUPPORTED``; a new store is one
lock backend module and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from django.core.cache.backends.db import DatabaseCache
from django.core.cache.backends.dummy import DummyCache
from django.core.cache.backends.filebased import FileBasedCache
from django.core.cache.backends.memcached import BaseMemcachedCache
from django.utils.module_loading import import_string

from .cluster import ValkeyClusterBackend
from .locmem import LocMemBackend
from .memcached import MemcachedBackend
from .pylibmc import PyLibMCBackend
from .redis import DjangoRedisBackend, RedisBackend
from .valkey import ValkeyBackend

if TYPE_CHECKING:
    from .base import LockBackend

__all__ = [
    "SUPPORTED",
    "UNSUPPORTED",
    "Supported",
    "cache_class",
    "recommended_paths",
    "supported_for",
    "supported_names",
]


@dataclass(frozen=True)
class Supported:
    """A Django cache class that can hold locks, and the lock backend for it."""

    #: The cache class's dotted path, as CACHES names it.
    path: str
    #: Its name in messages.
    name: str
    #: The lock backend speaking to it.
    backend: type[LockBackend]
    #: Whether a lock taken in one process is seen by the others.
    shared: bool = True
    #: Named in the hints of errors that ask for a shared cache.
    recommended: bool = True
    #: The package it needs beyond Django (the pip extra of django_tasklock).
    needs: str = ""
    #: What else to know, for the docs.
    notes: str = ""


SUPPORTED: Final = (
    Supported(
        "django.core.cache.backends.memcached.PyMemcacheCache",
        "PyMemcacheCache",
        MemcachedBackend,
        needs="pymemcache",
        notes="meta commands on memcached 1.6+, classic ones on older servers "
        "and twemproxy; restarts detected",
    ),
    Supported(
        "django.core.cache.backends.memcached.PyLibMCCache",
        "PyLibMCCache",
        PyLibMCBackend,
        recommended=False,
        needs="pylibmc (libmemcached)",
        notes="classic commands only",
    ),
    Supported(
        "django.core.cache.backends.redis.RedisCache",
        "RedisCache",
        RedisBackend,
        needs="redis",
        notes="one primary (its replicas read only)",
    ),
    Supported(
        "django_redis.cache.RedisCache",
        "django-redis's RedisCache",
        DjangoRedisBackend,
        needs="django-redis",
        notes="its DefaultClient or SentinelClient",
    ),
    Supported(
        "django_valkey.cluster_cache.cache.ClusterValkeyCache",
        "django-valkey's ClusterValkeyCache",
        ValkeyClusterBackend,
        needs="django-valkey",
        notes="a Valkey or Redis Cluster: each lock's keys in one hash slot; "
        "no liveness records yet (a crashed holder's lock lasts LOCK_EXPIRE)",
    ),
    Supported(
        "django_valkey.cache.ValkeyCache",
        "django-valkey's ValkeyCache",
        ValkeyBackend,
        needs="django-valkey",
        notes="its default client: one primary (its replicas read only)",
    ),
    Supported(
        "django.core.cache.backends.locmem.LocMemCache",
        "(one process only) LocMemCache",
        LocMemBackend,
        shared=False,
        recommended=False,
        notes="tests and development: locks hold within one process",
    ),
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
        "and then an UPDATE, so two processes can both take the lock",
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
