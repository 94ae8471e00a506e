"""The system check of PostgresCache aliases (``PostgresBackend.alias_checks``),
and the same refusal at run time (``PostgresCache.wire``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.checks import Error
from django.db import connections

from ...check_ids import POSTGRES_DATABASE_INVALID
from .runs import FAILOVERS

if TYPE_CHECKING:
    from django.core.checks import CheckMessage

__all__ = ["alias_checks", "database_problem"]


def database_problem(
    what: str, database: str, failover: object = "asynchronous", listen: object = None
) -> str | None:
    """Why a PostgresCache (``what``: its name in the message) cannot lock in
    the database its LOCATION names (``database``) with its
    ``OPTIONS["FAILOVER"]`` (``failover``) and ``OPTIONS["LISTEN"]``
    (``listen``); None if it can."""
    if failover not in FAILOVERS:
        return (
            f"{what}: OPTIONS['FAILOVER'] is {failover!r}. Set it to "
            "'synchronous' if a standby is promoted only when it has every commit "
            "the primary acknowledged (synchronous replication, e.g. Patroni's "
            "synchronous_mode_strict), or 'asynchronous' (the default: a promoted "
            "standby is treated as a restart)."
        )
    found = _not_postgres(database)
    if found is not None:
        return (
            f"{what}: LOCATION names database {database!r}, {found}. The lock "
            "table needs PostgreSQL: set LOCATION to the DATABASES alias of a "
            "PostgreSQL database (django.db.backends.postgresql; by default "
            "'default'), or lock in memcached or Redis."
        )
    if listen is not None and (
        not isinstance(listen, str) or _not_postgres(listen) is not None
    ):
        return (
            f"{what}: OPTIONS['LISTEN'] is {listen!r}, not the DATABASES alias of "
            "a PostgreSQL database. Set it to an alias that connects to the lock "
            "table's primary directly (not through a transaction pooler), where "
            "each release wakes the lock's waiters; or to None, and they poll."
        )
    return None


def _not_postgres(database: str) -> str | None:
    """What DATABASES[``database``] is if not PostgreSQL's; None if it is."""
    config = connections.settings.get(database)
    if config is None:
        return "which DATABASES does not have"
    if config.get("ENGINE") != "django.db.backends.postgresql":
        return f"whose ENGINE is {config.get('ENGINE')!r}, not PostgreSQL"
    return None


def alias_checks(
    alias: str, config: dict[str, Any], protocol: object, hint: str
) -> list[CheckMessage]:
    """E025: LOCATION names a PostgreSQL database, OPTIONS["FAILOVER"] is one
    this store knows, and OPTIONS["LISTEN"] names a PostgreSQL database or
    is None."""
    where = f"CACHES[{alias!r}] (PostgresCache)"
    options = config.get("OPTIONS") or {}
    database = config.get("LOCATION") or "default"
    failover = options.get("FAILOVER", "asynchronous")
    listen = options.get("LISTEN", database)
    problem = database_problem(where, database, failover, listen)
    if problem is None:
        return []
    return [Error(problem, hint=hint, id=POSTGRES_DATABASE_INVALID)]
