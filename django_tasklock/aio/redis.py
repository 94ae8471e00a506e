"""Locks on Redis from an event loop, through ``redis.asyncio``: the sync
backend's scripts (taken by SHA, sent whole when the server lacks them), on
the primary the sync backend talks to, over a connection pool of the loop's
own built with the same address and options."""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

from ..backends.redis import _ACQUIRE, _RELEASE, _SHA, known
from .base import AsyncBackend
from .finishing import carried_through

if TYPE_CHECKING:
    from ..backends import Hold
    from ..backends.redis import RedisBackend

__all__ = ["POOL_SIZE", "AsyncRedis", "async_pool_options"]

#: The most connections one loop keeps open to the primary.
POOL_SIZE = 32

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
    import redis
    import redis.asyncio

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


class AsyncRedis(AsyncBackend):
    """The loop's connections to the primary of a Redis alias."""

    native = True

    def __init__(self, sync: RedisBackend, options: dict[str, Any]) -> None:
        super().__init__(sync)
        import redis.asyncio
        import redis.exceptions

        # Its own pool, closed with it (aclose): at most POOL_SIZE
        # connections, a command waiting for one when all are busy (a loop of
        # a thousand coroutines must not open a thousand sockets). The wait is
        # this backend's (``_slots``): redis-py's BlockingConnectionPool waits
        # on a condition under a timeout for every command, which cost more
        # than the rest of a lock's Python.
        pool = redis.asyncio.ConnectionPool(max_connections=POOL_SIZE, **options)
        self._slots = asyncio.Semaphore(POOL_SIZE)
        if hasattr(redis.asyncio.Redis, "from_pool"):  # redis-py 5.0.1+
            self._client = redis.asyncio.Redis.from_pool(pool)
        else:
            self._client = redis.asyncio.Redis(
                connection_pool=pool, auto_close_connection_pool=True
            )
        self._no_script = redis.exceptions.NoScriptError
        self._dropped = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
        )
        self._encode = sync._encode

    async def _script(self, script: str, key: str, *args: Any) -> Any:
        async with self._slots:
            try:
                return await self._client.evalsha(_SHA[script], 1, key, *args)
            except self._no_script:
                return await self._client.eval(script, 1, key, *args)

    async def script(self, text: str, keys: tuple[str, ...], *args: Any) -> Any:
        # In a task of its own, as every command awaited in the caller's own
        # task here: redis-py's pool can lose a cancel that comes as it hands
        # the command a connection (the caller then runs on, cancelled in
        # name only, and an ``asyncio.timeout`` around it is not honoured).
        return await carried_through(self._script_anywhere(text, keys, *args))

    async def _script_anywhere(
        self, text: str, keys: tuple[str, ...], *args: Any
    ) -> Any:
        async with self._slots:
            try:
                return await self._client.evalsha(known(text), len(keys), *keys, *args)
            except self._no_script:
                return await self._client.eval(text, len(keys), *keys, *args)

    async def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        value = self._encode(token)
        milliseconds = math.ceil(expire * 1000)
        try:
            taken = await self._script(_ACQUIRE, key, value, milliseconds)
        except self._dropped:
            # As in the sync backend: the script may have run with its reply
            # lost; once more with the same token finds the lock ours if so.
            taken = await self._script(_ACQUIRE, key, value, milliseconds)
        return value if taken else None

    async def release(self, key: str, hold: Hold, token: object) -> bool:
        return bool(await self._script(_RELEASE, key, hold))

    async def held_many(self, keys: list[str]) -> list[bool]:
        values = await carried_through(self._mget(keys))  # see script()
        return [value is not None for value in values]

    async def _mget(self, keys: list[str]) -> list[Any]:
        async with self._slots:
            return await self._client.mget(keys)

    async def aclose(self) -> None:
        closing = getattr(self._client, "aclose", None) or self._client.close
        await closing()
