"""Which run of the database a new connection reached: a promoted standby (a
new timeline of the same cluster) or another cluster (a new system
identifier) may lack the last locks its predecessor committed (asynchronous
replication sends them after the commit), so it counts as a restart: new
locks wait ``RESTART_GRACE`` while live holders put back what it lacks
(``locks.liveness``, as after a memcached restart).

Each new connection reads the server's identity (system identifier and
current timeline) beside the run the table records (a row, ``RUN_KEY``,
replicated with the locks): the same, and the run's start is known; another,
and the first process to see it records the new run, with the server's time.
So a process that never met the old primary still knows the new one is
young. The reads are ``learning``'s steps (no I/O of its own): the sync and
the async connections drive them alike.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final

from .statements import TABLE

if TYPE_CHECKING:
    from collections.abc import Generator

    from .statements import Row

__all__ = ["IDENTITY", "RUN_KEY", "learning"]

logger = logging.getLogger("django_tasklock.backends.postgres")

#: The row of the table that records the database's run.
RUN_KEY: Final = "django_tasklock:run"

#: $1 the run's key: the server's identity, the run the table records (NULL:
#: none yet) and the server's time.
IDENTITY: Final = f"""
SELECT system_identifier::text || ':' ||
    substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8),
    (SELECT value FROM {TABLE} WHERE key = $1),
    extract(epoch FROM clock_timestamp())::float8
FROM pg_control_system()""".encode()

#: $1 the run's key, $2 the new run, $3 the run it replaces (NULL: none): the
#: run recorded unless another process recorded one first.
RECORD: Final = f"""
INSERT INTO {TABLE} AS t (key, value, expires) VALUES ($1, $2, 'infinity')
ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires = 'infinity'
WHERE t.value = $3 RETURNING 1""".encode()


def learning(
    where: str,
) -> Generator[tuple[bytes, tuple[str | None, ...]], list[Row], float | None]:
    """The steps that learn the run a new connection reached: each yields a
    statement and its parameters and is sent its rows. Returns when that run
    started (monotonic) if it may lack locks its predecessor held, else None
    (the first run the table records, or one that started long ago)."""
    identity, recorded, clock = (yield IDENTITY, (RUN_KEY,))[0]
    assert identity is not None  # (never NULL)
    assert clock is not None
    now, server_now = time.monotonic(), float(clock)
    if recorded is None:  # a new table: its first run loses nothing
        yield RECORD, (RUN_KEY, f"{identity}:0", None)
        return None
    known, _, since = recorded.rpartition(":")
    if known != identity:
        # Recorded unless another process did first: either way, young now.
        yield RECORD, (RUN_KEY, f"{identity}:{server_now}", recorded)
        logger.warning(
            "%s is a new run of the database (%s; the table recorded %s): a "
            "promoted standby, or another cluster. It may lack the last locks "
            "its predecessor took, so new locks wait TASKLOCK['RESTART_GRACE'] "
            "while their live holders put them back.",
            where,
            identity,
            known,
        )
        return now
    started = float(since)
    return None if started == 0 else now - max(0.0, server_now - started)
