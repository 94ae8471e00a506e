"""Which run of the database a new connection reached: a promoted standby (a
new timeline of the same cluster) or another cluster (a new system
identifier) may lack the last locks its predecessor committed (asynchronous
replication sends them after the commit), so it counts as a restart: new
locks wait ``RESTART_GRACE`` while live holders put back what it lacks
(``locks.liveness``, as after a memcached restart).

Each new connection reads the server's identity (system identifier and
current timeline) beside the run the table records (a row, ``RUN_KEY``,
replicated with the locks, made with the table): the same, and the run's
start is known; another, and the first process to see it records the new
run, with the server's time; none (the table's rows deleted), and which run
lost what is not known, so it is young too. So a process that never met the
old primary still knows the new one is young. Each take also checks a cheap
mark of the server's run (``statements.RUN_MARK``) so that a connection a
pooler sent to another server learns the run again. The reads are
``learning``'s steps (no I/O of its own): the sync and the async
connections drive them alike.

Where the project declares that only a synchronous standby is ever promoted
(the alias's ``OPTIONS["FAILOVER"] = "synchronous"``), a promoted standby of
the same cluster has every lock its predecessor acknowledged, and is not
young, if the predecessor's recorded run was synchronous: each run's record
says whether the primary waited for a standby's flush of every commit
(``synchronous_standby_names`` set, ``synchronous_commit`` ``on``,
``remote_write`` or ``remote_apply``) as the last new connection found it.
A connection that finds otherwise records the change, by a write: marked
synchronous, that write's own commit waited for the standby, which so has
every commit before it too. Another cluster (a new system identifier) is
always young.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final

from .statements import REPLICATION, RUN_KEY, RUN_MARK, SERVER_RUN, TABLE

if TYPE_CHECKING:
    from collections.abc import Generator

    from .statements import Row

__all__ = ["FAILOVERS", "IDENTITY", "RUN_KEY", "learning", "taken_on_run"]

logger = logging.getLogger("django_tasklock.backends.postgres")

#: What OPTIONS["FAILOVER"] may say of the alias's standbys: any may be
#: promoted (the default), or only one that had every acknowledged commit.
FAILOVERS: Final = ("asynchronous", "synchronous")

#: $1 the run's key: the server's identity, the run the table records (NULL:
#: none yet), the server's time, whether its commits wait for a standby, and
#: its run mark (``statements.RUN_MARK``).
IDENTITY: Final = f"""
SELECT {SERVER_RUN},
    (SELECT value FROM {TABLE} WHERE key = $1),
    extract(epoch FROM clock_timestamp())::float8,
    {REPLICATION},
    {RUN_MARK}
FROM pg_control_system()""".encode()

#: $1 the run's key, $2 the new run, $3 the run it replaces (NULL: none): the
#: run recorded unless another process recorded one first.
RECORD: Final = f"""
INSERT INTO {TABLE} AS t (key, value, expires) VALUES ($1, $2, 'infinity')
ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires = 'infinity'
WHERE t.value = $3 RETURNING 1""".encode()


def learning(
    where: str, synchronous: bool = False
) -> Generator[
    tuple[bytes, tuple[str | None, ...]], list[Row], tuple[float | None, str]
]:
    """The steps that learn the run a new connection reached (or one a
    pooler's connection was sent to): each yields a statement and its
    parameters and is sent its rows. Returns when that run started
    (monotonic) if it may lack locks its predecessor held, else None (the run
    the table was made on, one that started long ago, or, where only
    synchronous standbys are promoted (``synchronous``), a promoted standby of
    a run that was synchronous); and the server's run mark.

    A record reads ``system_id:timeline:started:mode`` (``started`` 0: the
    run loses nothing; ``mode`` ``s`` or ``a``; a record written before modes
    were recorded has none: asynchronous)."""
    identity, recorded, clock, mode, mark = (yield IDENTITY, (RUN_KEY,))[0]
    assert identity is not None  # (never NULL)
    assert clock is not None
    assert mode is not None
    assert mark is not None
    now, server_now = time.monotonic(), float(clock)
    if recorded is None:
        # The table is made with its run's record (statements.CREATE): this
        # one was deleted (a DELETE or TRUNCATE of the table's rows), and
        # which run lost what since is not known. Young, as a new run.
        yield RECORD, (RUN_KEY, f"{identity}:{server_now}:{mode}", None)
        logger.warning(
            "%s: the lock table holds no record of the database's run (its "
            "rows deleted or truncated?), so a failover since cannot be ruled "
            "out: new locks wait TASKLOCK['RESTART_GRACE'] while their live "
            "holders put them back.",
            where,
        )
        return now, mark
    system, timeline, since, was = [*recorded.split(":"), "a"][:4]
    known = f"{system}:{timeline}"
    if known != identity:
        promoted = synchronous and was == "s" and identity.startswith(f"{system}:")
        begun = "0" if promoted else f"{server_now}"
        # Recorded unless another process did first: either way, as it says.
        yield RECORD, (RUN_KEY, f"{identity}:{begun}:{mode}", recorded)
        _tell_new_run(where, identity, known, synchronous, was)
        return None if promoted else now, mark
    if was != mode:  # replicated otherwise now: recorded (see above)
        yield RECORD, (RUN_KEY, f"{identity}:{since}:{mode}", recorded)
        if synchronous and mode == "a":
            logger.warning(
                "%s commits without waiting for a synchronous standby "
                "(synchronous_standby_names, synchronous_commit), so a standby "
                "promoted after this run is treated as a restart despite "
                "OPTIONS['FAILOVER'] = 'synchronous'.",
                where,
            )
    started = float(since)
    return None if started == 0 else now - max(0.0, server_now - started), mark


def taken_on_run(mark: str | None, rows: list[Row]) -> bool | None:
    """Whether a take on the run (``statements.TAKE_ON_RUN``: one row, took
    and the server's run mark) took; None if the server is not on the run
    ``mark`` the connection learnt (it took nothing): the connection learns
    the run again, which is then judged, before a take is tried again."""
    took, now = rows[0]
    return None if now != mark else took == "1"


def _tell_new_run(
    where: str, identity: str, known: str, synchronous: bool, was: str
) -> None:
    """Log the new run ``identity`` met where the table recorded ``known``
    (``was``: that run's mode), and whether its new locks wait."""
    if not synchronous:
        why = ""
    elif not identity.startswith(known.partition(":")[0] + ":"):
        why = " (Another cluster: OPTIONS['FAILOVER'] covers promotions only.)"
    elif was != "s":
        why = (
            " (OPTIONS['FAILOVER'] is 'synchronous', but the run before it was "
            "seen committing without waiting for a standby.)"
        )
    else:
        logger.warning(
            "%s is a promoted standby (%s; the table recorded %s), and the run "
            "before it waited for a synchronous standby's flush of each commit: "
            "with OPTIONS['FAILOVER'] = 'synchronous' it has every lock its "
            "predecessor acknowledged, and new locks do not wait.",
            where,
            identity,
            known,
        )
        return
    logger.warning(
        "%s is a new run of the database (%s; the table recorded %s): a "
        "promoted standby, or another cluster. It may lack the last locks "
        "its predecessor took, so new locks wait TASKLOCK['RESTART_GRACE'] "
        "while their live holders put them back.%s",
        where,
        identity,
        known,
        why,
    )
