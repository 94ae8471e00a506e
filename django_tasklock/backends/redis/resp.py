"""One ``redis.asyncio`` connection of a loop's, its commands pipelined.

The commands of every coroutine go out on it in order, and their replies are
read in order by a task of its own, as memcached's
(``backends.memcached.aio``): a coroutine cancelled while its command is in
flight leaves the reply to that task, never unread, so the connection stays
in step, and a take's reply (whether the lock was taken) reaches the one who
must release it. redis-py's own client reads a reply in the caller's task, so
a cancel there drops the connection and the reply with it; this package ran
each command in a task of its own to keep the reply, which cost more than the
rest of a lock's Python.

What the two share, the line of waiters and what a cancel leaves, is
``backends.aio.pipeline``'s. The connection itself (address, password,
database, TLS, client name) is redis-py's, made from the same options as the
sync client's (``aio``), and so is the reading of replies (its parser, its
timeout: ``socket_timeout``)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ...foreign import stream_writer
from ..aio.pipeline import Pipeline

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


class Pipe(Pipeline):
    """A connected ``redis.asyncio`` connection, its commands pipelined
    (``Pipeline``) and their replies read by a task of its own."""

    store = "Redis"

    def __init__(self, conn: Any) -> None:
        import redis.exceptions

        super().__init__()
        self.conn = conn
        self.lost = redis.exceptions.ConnectionError
        self._error_reply = redis.exceptions.ResponseError
        self._idle: asyncio.Future[None] | None = None
        self._write = self._write_stream
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
                    self._deliver(await conn.read_response())
                except self._error_reply as error:  # a reply: still in step
                    self._deliver(None, error)
                read += 1
                if read % _REPLIES_AT_ONCE == 0:
                    # Replies already buffered are read with no pause: those
                    # of a thousand coroutines held the loop for 10 ms at once.
                    # (``read`` counts from the last time nothing was pending.)
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            self._fail(self.lost("the connection was closed"))
            raise
        except Exception as exc:  # lost, timed out, or out of step
            self._fail(exc)

    def _write_stream(self, command: bytes) -> None:
        # The connection's stream writer, written to at once: redis-py's
        # ``send_packed_command`` starts a task per write under a timeout and
        # drops the whole connection when its caller is cancelled mid-write.
        writer = stream_writer(self.conn)
        if writer is None:  # redis-py closed it, failing
            self.pending.pop()
            raise self.lost("Redis connection lost")
        writer.write(command)
        if writer.transport.get_write_buffer_size() > _HIGH_WATER:
            self._drain = writer.drain
        elif self._drain is not None:
            self._drain = None
        idle = self._idle
        if idle is not None and not idle.done():
            idle.set_result(None)

    def _close_transport(self) -> None:
        writer = stream_writer(self.conn)
        if writer is not None:
            writer.close()

    async def close(self) -> None:
        self.broken = True
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reading  # (it failed or was cancelled: closing anyway)
        await self.conn.disconnect()
