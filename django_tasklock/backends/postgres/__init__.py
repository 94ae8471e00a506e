"""Locks in a PostgreSQL table, for projects whose only store is their
database: ``cache.PostgresCache`` (Django's cache API on the table, named in
CACHES), ``backend`` (the lock operations), ``statements`` (the table and
every statement on it, no I/O) and ``wire`` (our own connection, every wait
bounded). psycopg is needed only where an alias names the cache."""

from __future__ import annotations

from typing import Final

from ..base import Supported
from .backend import PostgresBackend

__all__ = ["SUPPORTED", "PostgresBackend"]

#: This package's row of the supported-caches table.
SUPPORTED: Final = (
    Supported(
        "django_tasklock.backends.postgres.cache.PostgresCache",
        "PostgresCache",
        PostgresBackend,
        needs="postgres",
        notes="a table in a PostgreSQL database (LOCATION: its DATABASES alias), "
        "through PgBouncer's transaction pooling too",
    ),
)
