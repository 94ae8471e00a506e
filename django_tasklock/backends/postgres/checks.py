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
    what: str, database: str, failover: object = "asynchronous"
) -> str | None:
    """Why a PostgresCache (``what``: its name in the message) cannot lock in
    the database its LOCATION names (``database``) with its
    ``OPTIONS["FAILOVER"]`` (``failover``); None if it can."""
    if failover not in FAILOVERS:
        return (
            f"{what}: OPTIONS['FAILOVER'] is {failover!r}. Set it to "
            "'synchronous' if a standby is promoted only when it has every commit "
            "the primary acknowledged (synchronous replication, e.g. Patroni's "
            "synchronous_mode_strict), or 'asynchronous' (the default: a promoted "
            "standby is treated as a restart)."
        )
    config = connections.settings.get(database)
    if config is None:
        found = "which DATABASES does not have"
    elif config.get("ENGINE") != "django.db.backends.postgresql":
        found = f"whose ENGINE is {config.get('ENGINE')!r}, not PostgreSQL"
    else:
        return None
    return (
        f"{what}: LOCATION names database {database!r}, {found}. The lock table "
        "needs PostgreSQL: set LOCATION to the DATABASES alias of a PostgreSQL "
        "database (django.db.backends.postgresql; by default 'default'), or "
        "lock in memcached or Redis."
    )


def alias_checks(
    alias: str, config: dict[str, Any], protocol: object, hint: str
) -> list[CheckMessage]:
    """E025: LOCATION names a PostgreSQL database, and OPTIONS["FAILOVER"]
    is one this store knows."""
    where = f"CACHES[{alias!r}] (PostgresCache)"
    failover = (config.get("OPTIONS") or {}).get("FAILOVER", "asynchronous")
    problem = database_problem(where, config.get("LOCATION") or "default", failover)
    if problem is None:
        return []
    return [Error(problem, hint=hint, id=POSTGRES_DATABASE_INVALID)]
