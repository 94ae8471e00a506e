"""Locks on Redis from an event loop, through ``redis.asyncio``: the sync
backend's scripts (taken by SHA, sent whole when the server lacks them), on
the primary the sync backend talks to, over a connection of the loop's own
built with the same address and options, every command of the loop's
pipelined on it (``resp``): takes and releases, rate limits' scripts and
semaphores' reads."""

from __future__ import annotations

import asyncio
import functools
import math
from typing import TYPE_CHECKING, Any

# Imported with this module, which a loop's first lock on Redis imports on an
# executor thread (redis.asyncio costs a tenth of a second).
import redis
import redis.asyncio

from ..aio.base import Cancel, PipelinedBackend
from ..aio.finishing import carried_through, finish_later
from .backend import in_line_reply
from .resp import Pipe, pack
from .scripts import ACQUIRE, ACQUIRE_IN_LINE, RELEASE, Script, script_of, wake_key

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..base import Hold
    from .backend import RedisBackend

__all__ = ["AsyncRedis", "async_pool_options", "build"]

#: The connection options an asyncio connection takes as the sync one does.
_PASSED = (
    "host",
    "port",
    "path",
    "db",
    "username",
    "password",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "client_name",
    "health_check_interval",
    "retry_on_timeout",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_data",
    "ssl_check_hostname",
)


def async_pool_options(primary: Any) -> dict[str, Any] | None:
    """What ``redis.asyncio.ConnectionPool`` needs to reach the server the
    sync client ``primary`` reaches; None for a pool it cannot copy (Sentinel,
    which names its primary at connection time)."""
    pool = primary.connection_pool
    if type(pool) is not redis.ConnectionPool:
        return None
    classes = {
        redis.Connection: redis.asyncio.Connection,
        redis.SSLConnection: redis.asyncio.SSLConnection,
        redis.UnixDomainSocketConnection: redis.asyncio.UnixDomainSocketConnection,
    }
    connection_class = classes.get(pool.connection_class)
    if connection_class is None:
        return None
    kwargs = pool.connection_kwargs
    options = {name: kwargs[name] for name in _PASSED if name in kwargs}
    options["connection_class"] = connection_class
    return options


class AsyncRedis(PipelinedBackend):
    """The loop's connections to the primary of a Redis alias."""

    native = True

    def __init__(self, sync: RedisBackend, options: dict[str, Any]) -> None:
        super().__init__(sync)
        import redis.exceptions

        self._no_script = redis.exceptions.NoScriptError
        self._lost = redis.exceptions.ConnectionError
        self._dropped = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
        )
        self._encode = sync._encode
        self._connect_options = dict(options)
        self._connection_class = self._connect_options.pop("connection_class")
        self._pipe: Pipe | None = None
        self._opening: asyncio.Future[Pipe] | None = None
        #: Connections of waiters in line, idle: a blocking pop holds one
        #: to itself, never the pipelined one.
        self._waiting: list[Any] = []

    async def _connected(self) -> Pipe:
        """The loop's pipelined connection, made when first needed and again
        after it broke."""
        pipe = self._pipe
        if pipe is not None and not pipe.broken:
            return pipe
        opening = self._opening
        if opening is None:
            opening = self._opening = asyncio.ensure_future(self._connect())
            opening.add_done_callback(self._opened)
        return await asyncio.shield(opening)

    async def _connect(self) -> Pipe:
        conn = self._connection_class(**self._connect_options)
        await conn.connect()
        return Pipe(conn)

    def _opened(self, opening: asyncio.Future[Pipe]) -> None:
        self._opening = None
        if not opening.cancelled() and opening.exception() is None:
            self._pipe = opening.result()

    async def _run(
        self,
        script: Script,
        args: tuple[Any, ...],
        late: Callable[[Any], object] | None = None,
    ) -> Any:
        """``script``'s reply on the loop's pipelined connection: by its SHA,
        sent whole if the server lacks it."""
        try:
            return await self._sent(pack(b"EVALSHA", script.sha, *args), late)
        except self._no_script:
            return await self._sent(pack(b"EVAL", script.text, *args), late)

    async def script(self, text: str, keys: tuple[str, ...], *args: Any) -> Any:
        # A caller cancelled once it was sent leaves the reply to the
        # connection's reader: the script runs, its answer unread, as a sync
        # caller's whose reply timed out.
        script = script_of(text)
        args = (len(keys), *keys, *args)
        try:
            return await self._run(script, args)
        except self._dropped:  # (as redis-py's own client retries)
            return await self._run(script, args)

    async def take(
        self,
        key: str,
        token: str,
        expire: float,
        cancel: Cancel | None,
    ) -> Hold | None:
        # No task of its own: a cancel once the command is written leaves its
        # reply to the connection's reader, which hands it to ``cancel``.
        value = self._encode(token)
        args = (1, key, value, math.ceil(expire * 1000))
        landed = _Taken(value, cancel, self._lost)
        try:
            taken = await self._run(ACQUIRE, args, landed)
        except self._dropped:
            # As in the sync backend: the script may have run with its reply
            # lost; once more with the same token finds the lock ours if so.
            taken = await self._run(ACQUIRE, args, landed)
        return value if taken else None

    async def take_in_line(
        self,
        key: str,
        token: str,
        expire: float,
        waiter: str,
        mark: float,
        cancel: Cancel | None,
    ) -> tuple[Hold | None, float]:
        value = self._encode(token)
        args = (1, key, value, math.ceil(expire * 1000), waiter, math.ceil(mark * 1000))
        landed = _Taken(value, cancel, self._lost)
        try:
            reply = await self._run(ACQUIRE_IN_LINE, args, landed)
        except self._dropped:  # (as take: the same token finds it ours)
            reply = await self._run(ACQUIRE_IN_LINE, args, landed)
        return in_line_reply(value, reply)

    async def wait_turn(self, key: str, waiter: str, timeout: float) -> bool:
        # On a connection of its own: a blocking pop on the pipelined one
        # would hold up every other command of the loop behind it.
        conn = self._waiting.pop() if self._waiting else None
        if conn is None:
            conn = self._connection_class(**self._connect_options)
        done = False
        try:
            await conn.send_command("BLPOP", wake_key(key, waiter), timeout)
            woken = await conn.read_response() is not None
            done = True
        finally:
            if done and len(self._waiting) < 8:
                self._waiting.append(conn)
            else:  # cancelled or failed mid-command: its reply is unknown
                await conn.disconnect()
        return woken

    async def drop(self, key: str, hold: Hold, token: object) -> bool:
        pipe = self._pipe
        if pipe is None or pipe.broken:
            # Not sent before a new connection: carried to its end through a
            # cancel, the connection made first.
            return bool(await carried_through(self._run(RELEASE, (1, key, hold))))
        # Once written, the release is carried out and its reply read, whether
        # or not the caller waits for it; a server that lacked the script is
        # sent it whole then too.
        late = functools.partial(self._released_late, key, hold)
        return bool(await self._run(RELEASE, (1, key, hold), late))

    def _released_late(self, key: str, hold: Hold, reply: Any) -> None:
        """The reply to a release whose caller was cancelled."""
        if isinstance(reply, self._no_script):
            finish_later(self._run(RELEASE, (1, key, hold)))

    async def held_many(self, keys: list[str]) -> list[bool]:
        command = pack(b"MGET", *keys)
        try:
            values = await self._sent(command)
        except self._dropped:  # a connection closed while idle: once more
            values = await self._sent(command)
        return [value is not None for value in values]

    async def _sent(
        self, command: bytes, late: Callable[[Any], object] | None = None
    ) -> Any:
        """``command``'s reply on the loop's pipelined connection, made first
        if there is none (``late``: as ``Pipe.send``'s)."""
        pipe = self._pipe
        if pipe is None or pipe.broken:
            pipe = await self._connected()
        return await pipe.send(command, None, late)

    async def aclose(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            await pipe.close()
        waiting, self._waiting = self._waiting, []
        for conn in waiting:
            await conn.disconnect()


class _Taken:
    """What becomes of the reply of a take whose caller was cancelled once it
    was sent: a lock it took is released; a connection lost first leaves its
    fate unknown (``cancel``); an error reply took nothing."""

    __slots__ = ("cancel", "lost", "value")

    def __init__(
        self, value: bytes, cancel: Cancel | None, lost: type[Exception]
    ) -> None:
        self.value, self.cancel, self.lost = value, cancel, lost

    def __call__(self, reply: Any) -> None:
        cancel = self.cancel
        if cancel is None:
            return
        if reply is None:
            cancel.failed(self.lost("Redis connection lost"))
        elif reply == 1:  # (ACQUIRE_IN_LINE answers a refusal below 0)
            finish_later(cancel.taken(self.value))


def build(sync: RedisBackend) -> AsyncRedis | None:
    """A loop's client of ``sync``'s server; None where the pool cannot be
    copied (Sentinel): the sync backend on executor threads serves it then."""
    options = async_pool_options(sync._redis(""))
    return None if options is None else AsyncRedis(sync, options)
