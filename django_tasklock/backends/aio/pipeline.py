"""Commands of every coroutine of a loop pipelined on one connection, their
replies handed out in order: what the memcached client (``backends.memcached.aio``)
and the Redis one (``backends.redis.resp``) share.

A store answers a connection's commands in the order they came, so the n-th
reply read is the n-th waiter's. A coroutine cancelled once its command is
written leaves its waiter in the line: the reply is still read, the
connection stays in step, and the reply goes to the ``late`` handler the
command was sent with (a take's: release what it took). A connection that
fails hands every waiter the loss, and every late handler None: the fate of
those commands is unknown.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Any

from .watch import watch

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["Pipeline"]


class Pipeline:
    """The waiters of one connection's commands, in the order they were sent.

    A subclass sets ``_write``, reads replies and hands each to
    ``_deliver``, and closes (``_close_transport``). ``broken`` once the
    connection failed: a new one is made for what comes next.
    """

    #: What a waiter gets when the connection is lost (the store client's
    #: own connection error, so callers catch one kind).
    lost: type[Exception] = ConnectionResetError
    #: The store's name, in messages.
    store = "memcached"

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        #: What to do with the reply of a command whose caller was cancelled
        #: (None: the connection failed first), by the caller's waiter.
        self.late: dict[asyncio.Future[Any], Callable[[Any], object]] = {}
        self.broken = False
        #: Set while the transport's buffer is above its high-water mark: a
        #: command waits on it before its reply.
        self._drain: Callable[[], Awaitable[None]] | None = None
        self.loop = self._loop
        #: The longest a reply may be awaited (``watch``); 0 until a command
        #: is sent with a timeout, and the connection watched.
        self.timeout = 0.0

    #: Writes a command (the transport's own ``write`` where it needs no
    #: more: a call less per command).
    _write: Callable[[bytes], object]

    def _close_transport(self) -> None:
        raise NotImplementedError

    def _deliver(self, reply: Any, error: BaseException | None = None) -> None:
        """The next reply in line (an error reply as ``error``): to its
        waiter, or to the late handler of a cancelled caller."""
        waiter = self.pending.popleft()
        if not waiter.done():
            if error is None:
                waiter.set_result(reply)
            else:
                waiter.set_exception(error)
        elif self.late:  # its caller was cancelled
            handler = self.late.pop(waiter, None)
            if handler is not None:
                handler(reply if error is None else error)

    def stalled(self, head: asyncio.Future[Any]) -> None:
        """The watch found ``head`` first in line for a whole timeout: no
        reply came for that long, and the connection fails (if ``head`` is
        still waiting first: a reply may have come meanwhile)."""
        if not self.broken and self.pending and self.pending[0] is head:
            self._fail(TimeoutError(f"no reply within {self.timeout:g}s"))

    def _fail(self, exc: BaseException) -> None:
        """The connection is lost: every command in flight with it."""
        self.broken = True
        self._close_transport()
        while self.pending:
            waiter = self.pending.popleft()
            if not waiter.done():
                waiter.set_exception(
                    self.lost(f"{self.store} connection lost: {exc!r}")
                )
            else:
                handler = self.late.pop(waiter, None)
                if handler is not None:
                    handler(None)

    async def send(
        self,
        command: bytes,
        timeout: float | None = None,
        late: Callable[[Any], object] | None = None,
    ) -> Any:
        """``command``'s reply (an error reply raised). One not come within
        ``timeout`` seconds (and at most a quarter more: ``watch``) breaks the
        connection: what was in flight on it is out of step. If the caller is
        cancelled once the command is written, ``late`` gets its reply when it
        comes (None if the connection fails first)."""
        if self.broken:
            raise self.lost(f"{self.store} connection lost")
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self.pending.append(waiter)
        self._write(command)
        if timeout is not None and not self.timeout:
            self.timeout = timeout
            watch(self)
        if late is not None:
            # Before any await: the reply of a cancelled caller may be read
            # before that caller resumes.
            self.late[waiter] = late
        try:
            drain = self._drain
            if drain is not None:
                await drain()
            reply = await waiter
        except asyncio.CancelledError:
            if not waiter.done():  # (cancelled while the write drained)
                waiter.cancel()
            elif not waiter.cancelled():
                # The reply came, and then the cancel, before this resumed.
                handler = self.late.pop(waiter, None)
                if handler is not None:
                    error = waiter.exception()
                    if error is None:
                        handler(waiter.result())
                    else:  # an error reply; or the connection lost: fate unknown
                        handler(None if isinstance(error, self.lost) else error)
            raise  # (a cancelled waiter's handler is the reader's to call)
        except BaseException:
            self.late.pop(waiter, None)
            raise
        if late is not None:
            del self.late[waiter]
        return reply
