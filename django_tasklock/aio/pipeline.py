"""Commands of every coroutine of a loop pipelined on one connection, their
replies handed out in order: what the memcached client (``aio.memcached``)
and the Redis one (``aio.resp``) share.

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

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["Pipeline"]

#: How many looks a reply's timeout is watched in (``Pipeline._watch``).
_LOOKS = 4


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
        #: The watch on replies (``_watch``), while one is due; the longest a
        #: reply may be awaited; the first waiter in line when last looked,
        #: and at how many looks in a row.
        self._watching: asyncio.TimerHandle | None = None
        self._timeout = 0.0
        self._head: asyncio.Future[Any] | None = None
        self._looks = 0

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

    def _watch(self) -> None:
        """No reply for ``_timeout`` seconds while commands wait: the server
        stalled (or the network), and the connection fails, and with it every
        command in flight. Looked at four times a timeout while something is
        in line (not a timer per command: none on the hot path): the same
        waiter first in line at five looks in a row has waited a timeout and
        at most a quarter more."""
        self._watching = None
        pending = self.pending
        if self.broken or not pending:
            self._head = None
            return
        if pending[0] is self._head:
            self._looks += 1
            if self._looks >= _LOOKS:
                timeout = self._timeout
                self._fail(TimeoutError(f"no reply within {timeout:g}s"))
                return
        else:
            self._head, self._looks = pending[0], 0
        self._watching = self._loop.call_later(self._timeout / _LOOKS, self._watch)

    def _fail(self, exc: BaseException) -> None:
        """The connection is lost: every command in flight with it."""
        self.broken = True
        watching, self._watching = self._watching, None
        if watching is not None:
            watching.cancel()
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
        ``timeout`` seconds (and at most a quarter more: ``_watch``) breaks the
        connection: what was in flight on it is out of step. If the caller is
        cancelled once the command is written, ``late`` gets its reply when it
        comes (None if the connection fails first)."""
        if self.broken:
            raise self.lost(f"{self.store} connection lost")
        waiter: asyncio.Future[Any] = self._loop.create_future()
        self.pending.append(waiter)
        self._write(command)
        if timeout is not None and self._watching is None:
            self._timeout = timeout
            self._watching = self._loop.call_later(timeout / _LOOKS, self._watch)
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
