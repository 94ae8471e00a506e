"""What the PostgreSQL store's connection raises (importable without psycopg)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "MissingTable",
    "PostgresError",
    "StatementFailed",
    "Unreachable",
    "run_changed",
]


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


def run_changed(session: Any) -> Unreachable:
    """The error of a take whose server changed runs again while its
    connection learnt the run it had changed to (``runs.taken_on_run``)."""
    return Unreachable(
        f"{session.where} changed runs twice during one take (a pooler sending "
        "the connection from server to server?): nothing was taken"
    )
