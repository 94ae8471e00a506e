"""One connection of our own to PostgreSQL, every wait on it bounded.

libpq (``psycopg.pq``, psycopg's documented low-level module) in nonblocking
mode, driven here: a connect, a statement sent and its reply read all wait on
the socket with a deadline of ours (``TASKLOCK['SOCKET_TIMEOUT']``), so a
server that stopped answering (frozen, partitioned, a pooler in front of a
dead primary) is an error within the bound, never a wait without end. A
statement that timed out leaves the connection closed: its outcome is not
known, which the lock layer treats as such (``orphans``).

Each statement is sent with the extended protocol and no name (no
server-side prepared statement, no session state: it works through
PgBouncer's transaction pooling), in autocommit: never inside a transaction
of the caller's, whose connection is Django's, not this one.
"""

from __future__ import annotations

import os
import select
import time
from typing import TYPE_CHECKING, Any, Final

from psycopg import OperationalError, pq

from .errors import MissingTable, StatementFailed, Unreachable
from .runs import learning

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Sequence

    from .statements import Row

__all__ = [
    "READ",
    "WRITE",
    "Wire",
    "connect_steps",
    "late",
    "rows_of",
    "statement_steps",
]

_POLL_IN: Final = select.POLLIN | select.POLLERR | select.POLLHUP
_POLL_OUT: Final = select.POLLOUT | select.POLLERR | select.POLLHUP
#: SQLSTATE classes of errors that mean the server cannot serve us now: a
#: connection failure (08), insufficient resources (53), an operator's
#: intervention (57: shutdown, a cancelled statement), a system error (58),
#: and a read-only transaction (25006: a standby, not the primary).
_UNAVAILABLE: Final = ("08", "53", "57", "58", "25006")

_TUPLES_OK: Final = int(pq.ExecStatus.TUPLES_OK)
_COMMAND_OK: Final = int(pq.ExecStatus.COMMAND_OK)


class Wire:
    """A connection to one PostgreSQL server (or pooler), opened when first
    needed and again after it broke; for one thread and one process."""

    def __init__(
        self, conninfo: str, timeout: float, where: str, synchronous: bool = False
    ) -> None:
        self.conninfo = conninfo.encode()
        #: Seconds a connect or a statement may take.
        self.timeout = timeout
        #: The server, for messages.
        self.where = where
        #: Whether only synchronous standbys are promoted (``runs.learning``).
        self.synchronous = synchronous
        self._conn: pq.abc.PGconn | None = None
        self._pid = 0
        #: When the run of the database it reached started, if that run may
        #: lack locks its predecessor held (``runs.learning``), else None.
        self.run_started: float | None = None
        #: The run mark of the server it learnt (``statements.RUN_MARK``).
        self.mark: str | None = None
        #: The connection being made (``connect_steps``).
        self._connecting: Any = None
        #: A poll of the connection's socket for replies (made with it).
        self._readable = select.poll()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and self._pid == os.getpid():
            conn.finish()

    def query(
        self,
        sql: bytes,
        params: Sequence[str | None],
        guard: Callable[[Wire], object] | None = None,
        on_run: bool = False,
    ) -> list[Row]:
        """Run one statement; its rows, each a tuple of texts (None: NULL).
        ``guard(wire)``, where given, runs before the statement is sent
        whenever the run of the database the connection reached (learnt when
        it was made: ``runs``) may lack locks: it may refuse the statement.
        ``on_run``: the run mark learnt is sent as the last parameter (a
        statement made only on that run)."""
        conn = self._conn
        if conn is None or self._pid != os.getpid():
            conn = self._connect()
        elif self._readable.poll(0):
            conn = self._unasked(conn)
        if guard is not None and self.run_started is not None:
            guard(self)
        if on_run:
            params = (*params, self.mark)
        now = time.monotonic()
        # ``statement_steps``, inlined: driven through the generator, a Lock
        # cycle took 7,100 more instructions (6.7 %; make bench-cpu's harness,
        # 59.1k -> 66.2k for the bare two statements). The async connection
        # drives the generator.
        try:
            conn.send_query_params(
                sql, [None if p is None else p.encode() for p in params]
            )
            deadline = now + self.timeout
            while conn.flush():  # (rare: a statement larger than the socket takes)
                self._wait(conn, _POLL_OUT, deadline)
            result = None
            while True:
                while conn.is_busy():
                    left = deadline - time.monotonic()
                    if left <= 0 or not self._readable.poll(left * 1000):
                        raise late(self)
                    conn.consume_input()
                last = conn.get_result()
                if last is None:
                    break
                result = last
        except OperationalError as exc:
            self.close()
            raise Unreachable(f"{self.where}: {exc}") from None
        except Unreachable:
            self.close()
            raise
        return rows_of(self, result)

    def _unasked(self, conn: pq.abc.PGconn) -> pq.abc.PGconn:
        """The connection to send on after bytes came unasked between
        statements: the same if they were only notifications (a ``LISTEN`` a
        transaction pooler left on its server connection), dropped; else a
        new one, since the server ended the session (a restart, a pooler's,
        an idle timeout). Nothing of the statement was sent yet."""
        try:
            conn.consume_input()
        except OperationalError:
            notified = False
        else:
            notified = conn.status == pq.ConnStatus.OK and conn.notifies() is not None
            while conn.notifies() is not None:
                pass
        if notified and not self._readable.poll(0):
            return conn
        self.close()
        return self._connect()

    def notified(self, timeout: float) -> list[str]:
        """The payloads of the notifications that came within ``timeout``
        seconds, on a connection that sent ``LISTEN`` (and no statement
        since); raises ``Unreachable`` once it broke."""
        conn = self._conn
        if conn is None:
            raise Unreachable(f"{self.where}: not connected")
        payloads: list[str] = []
        if self._readable.poll(timeout * 1000):
            try:
                conn.consume_input()
            except OperationalError as exc:
                self.close()
                raise Unreachable(f"{self.where}: {exc}") from None
            while (notify := conn.notifies()) is not None:
                payloads.append(notify.extra.decode())
        if conn.status != pq.ConnStatus.OK:
            self.close()
            raise Unreachable(f"{self.where}: the connection broke")
        return payloads

    def _connect(self) -> pq.abc.PGconn:
        conn = self._connected()
        self.relearn()
        return conn

    def relearn(self) -> None:
        """Learn the run of the server the connection reaches (``runs``):
        when it is made, and when a pooler sent it to another server."""
        steps = learning(self.where, self.synchronous)
        try:
            ask = next(steps)
            while True:
                ask = steps.send(self.query(*ask))
        except StopIteration as done:
            self.run_started, self.mark = done.value

    def _connected(self) -> pq.abc.PGconn:
        self._conn = None
        deadline = time.monotonic() + self.timeout
        steps = connect_steps(self)
        try:
            want = next(steps)
            while True:
                events = _POLL_IN if want == READ else _POLL_OUT
                self._wait(self._connecting, events, deadline)
                want = steps.send(None)
        except StopIteration as done:
            conn: pq.abc.PGconn = done.value
        except BaseException:
            steps.close()  # (the connection half made is finished)
            raise
        self._readable = select.poll()
        self._readable.register(conn.socket, _POLL_IN)
        self._conn, self._pid = conn, os.getpid()
        return conn

    def _wait(self, conn: pq.abc.PGconn, events: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left > 0:
            poller = select.poll()
            poller.register(conn.socket, events)
            if poller.poll(left * 1000):
                return
        raise late(self)


#: What a protocol step waits for: the socket readable, or writable (small
#: ints, one object each: told apart from a result by identity).
READ: Final = -1
WRITE: Final = -2


def statement_steps(
    conn: pq.abc.PGconn, sql: bytes, params: Sequence[str | None]
) -> Generator[Any, None, None]:
    """One statement on ``conn``, no waiting of its own: it yields ``READ``
    or ``WRITE`` where the socket must be ready first, then, last, the
    statement's last result (None: the connection broke before any). The
    async connection drives it (the sync one, inlined). Its result is a last
    yield, not a return: catching StopIteration cost 1,700 instructions a
    Lock cycle more.)"""
    conn.send_query_params(sql, [None if p is None else p.encode() for p in params])
    while conn.flush():  # (rare: a statement larger than the socket takes)
        yield WRITE
    result = None
    while True:
        while conn.is_busy():
            yield READ
            conn.consume_input()
        last = conn.get_result()
        if last is None:
            yield result
            return
        result = last


def connect_steps(session: Any) -> Generator[int, None, pq.abc.PGconn]:
    """A connection to ``session.conninfo`` (kept at ``session._connecting``
    while it is made), as ``statement_steps`` waits: nonblocking once made."""
    conn = session._connecting = pq.PGconn.connect_start(session.conninfo)
    try:
        while True:
            state = conn.connect_poll()
            if state == pq.PollingStatus.OK:
                break
            if state == pq.PollingStatus.FAILED:
                said = conn.get_error_message().strip()
                if "read-only" in said:
                    said += _READ_ONLY
                raise Unreachable(f"{session.where}: {said}")
            yield READ if state == pq.PollingStatus.READING else WRITE
        conn.nonblocking = 1
    except BaseException:
        conn.finish()
        raise
    return conn


_READ_ONLY: Final = (
    " (a standby, or a server that cannot write: locks and liveness records "
    "are read and written on the primary only. Point the DATABASES entry at "
    "the primary)"
)


def late(session: Any) -> Unreachable:
    """The error of a reply that did not come within ``session.timeout``."""
    return Unreachable(
        f"{session.where} did not answer within {session.timeout:g} s "
        "(TASKLOCK['SOCKET_TIMEOUT'])"
    )


def rows_of(session: Any, result: pq.abc.PGresult | None) -> list[Row]:
    """``result``'s rows, each a tuple of texts (None: NULL); its error
    raised as what it means (``session``: its connection, closed where the
    error ends it)."""
    if result is None:  # (the connection broke before any reply)
        conn = session._conn
        session.close()
        said = conn.get_error_message() if conn is not None else b""
        raise Unreachable(f"{session.where}: {said.decode(errors='replace').strip()}")
    status = result.status
    if status == _TUPLES_OK:
        get = result.get_value
        columns = range(result.nfields)
        return [
            tuple(
                None if (value := get(row, column)) is None else value.decode()
                for column in columns
            )
            for row in range(result.ntuples)
        ]
    if status == _COMMAND_OK:
        return []
    state = (result.error_field(pq.DiagnosticField.SQLSTATE) or b"").decode()
    message = (result.error_message or b"").decode().strip()
    if state == "42P01":
        raise MissingTable(message)
    conn = session._conn
    if state.startswith(_UNAVAILABLE) or (
        conn is None or conn.status != pq.ConnStatus.OK
    ):
        session.close()
        raise Unreachable(f"{session.where}: {message} (SQLSTATE {state})")
    raise StatementFailed(f"{session.where}: {message} (SQLSTATE {state})")
