"""One ``redis.asyncio`` connection of a loop's, its commands pipelined.

The commands of every coroutine go out on it in order, and their replies are
read in order by a task of its own, as memcached's (``aio.memcached``): a
coroutine cancelled while its command is in flight leaves the reply to that
task, never unread, so the connection stays in step, and a take's reply
(whether the lock was taken) reaches the one who must release it. redis-py's
own client reads a reply in the caller's task, so a cancel there drops the
connection and the reply with it; this package ran each command in a task of
its own to keep the reply, which cost more than the rest of a lock's Python.

The connection itself (address, password, database, TLS, client name) is
redis-py's, made from the same options as the sync client's (``aio.redis``),
and so is the reading of replies (its parser, its timeout: ``socket_timeout``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Pipe", "pack"]

#: Bytes waiting to be sent past which a command waits for them to go.
_HIGH_WATER = 1 << 16
#: Replies read in a row before the reader lets the loop run other callbacks.
_REPLIES_AT_ONCE = 32


def pack(*args: bytes | str | int) -> bytes:
    """A command as RESP: an array of bulk strings (text as UTF-8, as the
    sync client sends it)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


class Pipe:
    """A connected ``redis.asyncio`` connection, its replies read by a task
    of its own. ``broken`` once it failed: a new one is made for what comes
    next."""

    def __init__(self, conn: Any) -> None:
        import redis.exceptions

        self.conn = conn
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        #: What to do with the reply of a command whose caller was cancelled
        #: (None: the connection failed first), by the caller's waiter.
        self.late: dict[asyncio.Future[Any], Callable[[Any], object]] = {}
        self.broken = False
        self._error_reply = redis.exceptions.ResponseError
        self._lost = redis.exceptions.ConnectionError
        self._idle: asyncio.Future[None] | None = None
        self._reading = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        conn, pending = self.conn, self.pending
        loop = asyncio.get_running_loop()
        read = 0
        try:
            while True:
                if not pending:
                    read = 0
                    self._idle = loop.create_future()
                    await self._idle
                    continue
                try:
                    reply: Any = await conn.read_response()
                except self._error_reply as error:  # a reply: still in step
                    reply = error
                read += 1
                waiter = pending.popleft()
                if not waiter.done():
                    if isinstance(reply, BaseException):
                        waiter.set_exception(reply)
                    else:
                        waiter.set_result(reply)
                elif self.late:  # its caller was cancelled
                    handler = self.late.pop(waiter, None)
                    if handler is not None:
                        handler(reply)
                if read % _REPLIES_AT_ONCE == 0:
                    # Replies already buffered are read with no pause: those
                    # of a thousand coroutines held the loop for 10 ms at once.
                    # (``read`` counts from the last time nothing was pending.)
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._fail(self._lost("the connection was closed"))
            raise
        except Exception as exc:  # lost, timed out, or out of step
            self._fail(exc if isinstance(exc, self._lost) else self._lost(repr(exc)))

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        while self.pending:
            waiter = self.pending.popleft()
            if not waiter.done():
                waiter.set_exception(self._lost(f"Redis connection lost: {exc!r}"))
            else:
                handler = self.late.pop(waiter, None)
                if handler is not None:
                    handler(None)
        writer = getattr(self.conn, "_writer", None)
        if writer is not None:
            writer.close()

    async def send(
        self, command: bytes, late: Callable[[Any], object] | None = None
    ) -> Any:
        """``command``'s reply (an error reply raised). If the caller is
        cancelled once the command is written, ``late`` gets the reply when it
        comes (None if the connection fails first)."""
        writer = self.conn._writer
        if self.broken or writer is None:  # (None: redis-py closed it, failing)
            raise self._lost("Redis connection lost")
        waiter: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.pending.append(waiter)
        writer.write(command)
        if late is not None:
            # Before any await: the reader may take the reply of a cancelled
            # caller before that caller resumes.
            self.late[waiter] = late
        idle = self._idle
        if idle is not None and not idle.done():
            idle.set_result(None)
        try:
            if writer.transport.get_write_buffer_size() > _HIGH_WATER:
                await writer.drain()
            reply = await waiter
        except asyncio.CancelledError:
            if not waiter.done():
                waiter.cancel()
            elif not waiter.cancelled():
                # The reply came, and then the cancel, before this resumed.
                handler = self.late.pop(waiter, None)
                if handler is not None:
                    handler(
                        waiter.result()
                        if waiter.exception() is None
                        else waiter.exception()
                    )
            raise  # (a cancelled waiter's handler is the reader's to call)
        except BaseException:
            self.late.pop(waiter, None)
            raise
        if late is not None:
            del self.late[waiter]
        return reply

    async def close(self) -> None:
        self.broken = True
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reading  # (it failed or was cancelled: closing anyway)
        await self.conn.disconnect()
