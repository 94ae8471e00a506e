"""What the PostgreSQL store's connection raises (importable without psycopg)."""

from __future__ import annotations

__all__ = ["MissingTable", "PostgresError", "StatementFailed", "Unreachable"]


class PostgresError(Exception):
    """What this module raises."""


class Unreachable(PostgresError):
    """The server did not answer in time, or cannot serve us now (the
    connection is then closed): the store could not be reached."""


class MissingTable(PostgresError):
    """The lock table does not exist: its migration was not applied."""


class StatementFailed(PostgresError):
    """The server refused a statement for a reason of ours (a bug, or a table
    changed by hand)."""
