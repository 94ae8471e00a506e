"""Locks on PostgreSQL from an event loop: the sync backend's statements,
over a libpq connection of the loop's own.

The connection is libpq in nonblocking mode (as ``wire``'s), driven by the
loop: ``wire.statement_steps`` says when the socket must be readable or
writable, and the loop's reader and writer callbacks wake the statement, no
thread between. One statement at a time on it (libpq's rule outside
pipeline mode): the loop's coroutines take turns, each statement bounded by
``TASKLOCK['SOCKET_TIMEOUT']``. A take or release whose caller is cancelled
is carried to its end (``AsyncBackend.take``/``drop``), so no reply is left
unread on the connection.
"""

from __future__ import annotations

import asyncio
import select
import time
from typing import TYPE_CHECKING, Any

from psycopg import OperationalError

from ...conf import settings as tasklock_settings
from ..aio.base import AsyncBackend
from . import statements as sql
from .cache import conninfo_for
from .errors import Unreachable, run_changed
from .runs import learning, taken_on_run
from .wire import (
    READ,
    WRITE,
    connect_steps,
    late,
    rows_of,
    statement_steps,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Generator, Sequence

    from psycopg import pq

    from ..base import Hold, Peek
    from .backend import PostgresBackend
    from .statements import Row

__all__ = ["AsyncPostgres", "build"]


class _LoopWire:
    """The loop's connection to the alias's database, made when first needed
    and again after it broke."""

    def __init__(
        self, conninfo: str, timeout: float, where: str, synchronous: bool
    ) -> None:
        self.conninfo = conninfo.encode()
        self.timeout, self.where = timeout, where
        self.synchronous = synchronous
        self._conn: pq.abc.PGconn | None = None
        self._connecting: Any = None
        self._turn = asyncio.Lock()
        #: As ``Wire.run_started`` and ``Wire.mark``.
        self.run_started: float | None = None
        self.mark: str | None = None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish()

    async def query(
        self,
        statement: bytes,
        params: Sequence[str | None],
        guard: Callable[[Any], object] | None = None,
        on_run: bool = False,
        relearn: bool = False,
    ) -> list[Row]:
        """As ``Wire.query``, on the loop: one statement at a time; with
        ``relearn``, the run learnt again first (``Wire.relearn``)."""
        async with self._turn:
            conn = self._conn
            if conn is not None and _unasked(conn):
                self.close()  # (the server ended the session: nothing sent yet)
                conn = None
            deadline = time.monotonic() + self.timeout
            try:
                if conn is None:
                    steps: Generator[Any, None, Any] = connect_steps(self)
                    self._conn = conn = await self._driven(steps, deadline, True)
                    await self._learn(conn, deadline)
                elif relearn:
                    await self._learn(conn, deadline)
                if guard is not None and self.run_started is not None:
                    guard(self)
                if on_run:
                    params = (*params, self.mark)
                steps = statement_steps(conn, statement, params)
                result = await self._driven(steps, deadline, False)
            except OperationalError as exc:
                self.close()
                raise Unreachable(f"{self.where}: {exc}") from None
            except (Unreachable, asyncio.CancelledError):
                self.close()  # (a statement cut short leaves its reply unread)
                raise
            return rows_of(self, result)

    async def _learn(self, conn: pq.abc.PGconn, deadline: float) -> None:
        """The run the new connection ``conn`` reached (``runs.learning``)."""
        learn = learning(self.where, self.synchronous)
        try:
            ask = next(learn)
            while True:
                steps = statement_steps(conn, *ask)
                rows = rows_of(self, await self._driven(steps, deadline, False))
                ask = learn.send(rows)
        except StopIteration as done:
            self.run_started, self.mark = done.value

    async def _driven(
        self, steps: Generator[Any, None, Any], deadline: float, making: bool
    ) -> Any:
        """Drive ``steps`` (``connect_steps`` when ``making``, which return
        their connection; else ``statement_steps``) on the loop."""
        loop = asyncio.get_running_loop()
        try:
            want = next(steps)
            while True:
                if not making and want is not READ and want is not WRITE:
                    return want  # (the statement's result, its last step)
                conn: Any = self._connecting if making else self._conn
                await self._ready(loop, conn.socket, want == WRITE, deadline)
                want = steps.send(None)
        except StopIteration as done:  # (connect_steps return their connection)
            return done.value
        except BaseException:
            steps.close()  # (a connection half made is finished)
            raise

    async def _ready(
        self, loop: asyncio.AbstractEventLoop, fd: int, write: bool, deadline: float
    ) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise late(self)
        ready = loop.create_future()
        watch, unwatch = (
            (loop.add_writer, loop.remove_writer)
            if write
            else (loop.add_reader, loop.remove_reader)
        )
        # The future awaited itself, its deadline a timer: before Python 3.12,
        # asyncio.wait_for returned a result that landed in the same turn of
        # the loop as its caller's cancel, and the cancel was lost (a cancelled
        # blocking acquire waited on until it took the lock).
        watch(fd, _wake, ready, True)
        timer = loop.call_later(left, _wake, ready, False)
        try:
            in_time = await ready
        finally:
            timer.cancel()
            unwatch(fd)
        if not in_time:
            raise late(self)


def _wake(ready: asyncio.Future[bool], in_time: bool) -> None:
    if not ready.done():
        ready.set_result(in_time)


def _unasked(conn: pq.abc.PGconn) -> bool:
    """Whether bytes arrived on ``conn`` between statements (the server ended
    the session)."""
    readable, _, _ = select.select([conn.socket], [], [], 0)
    return bool(readable)


class AsyncPostgres(AsyncBackend):
    """The loop's connection to the database of a PostgresCache alias."""

    native = True

    def __init__(self, sync: PostgresBackend) -> None:
        super().__init__(sync)
        self._peeked, self._young = sync.peeked, sync.young
        cache = sync.cache
        timeout = tasklock_settings.SOCKET_TIMEOUT
        from django.db import connections

        conninfo = conninfo_for(connections[cache.database], timeout)
        self._wire = _LoopWire(conninfo, timeout, cache.where, cache.synchronous)

    async def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        params = (key, token, sql.seconds(expire))
        wire = self._wire
        for again in (False, True):
            rows = await wire.query(sql.TAKE_ON_RUN, params, self._young, True, again)
            taken = taken_on_run(wire.mark, rows)
            if taken is not None:
                return token if taken else None
        raise run_changed(wire)

    async def release(self, key: str, hold: Hold, token: object) -> bool:
        return bool(await self._wire.query(sql.RELEASE, (key, str(hold))))

    async def peek(self, key: str) -> Peek | None:
        rows = await self._wire.query(sql.READ, (key,))
        return self._peeked(rows)

    async def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        params = (key, str(hold), sql.seconds(expire), new)
        return new if await self._wire.query(sql.REPLACE, params) else None

    async def held_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        rows = await self._wire.query(sql.READ_MANY, (sql.array(keys),))
        held = {row[0] for row in rows}
        return [key in held for key in keys]

    async def aclose(self) -> None:
        self._wire.close()


def build(sync: PostgresBackend) -> AsyncPostgres:
    """A loop's client of ``sync``'s database."""
    return AsyncPostgres(sync)
