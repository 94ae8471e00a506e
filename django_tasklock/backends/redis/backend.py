"""Owner-checked locks on Redis: SET NX PX, and compare-then-act Lua scripts,
which Redis runs atomically.

``RedisBackend`` serves Django's own RedisCache; ``DjangoRedisBackend`` the
django-redis package's (its default and Sentinel clients). Both talk to the
primary only, with the cache's own serializer, so ``cache.get(lock_id)`` reads
the owner back as a str.
"""

from __future__ import annotations

import functools
import importlib
import math
import re
from typing import TYPE_CHECKING, Any, ClassVar

from django.conf import settings as django_settings

from ...foreign import django_cache_client, redis_serializer
from ...keys import encodable_key
from ..base import FenceCounter, Hold, LockBackend, Peek
from ..capabilities import ONE_PLACE
from .scripts import (
    ACQUIRE,
    ACQUIRE_IN_LINE,
    EXTEND,
    FENCE,
    LEAVE_LINE,
    RELEASE,
    REPLACE,
    TAKE_OVER,
    Script,
    script_of,
    wake_key,
)
from .sockets import close_own, own_client

if TYPE_CHECKING:
    from collections.abc import Callable

    from django.core.cache.backends.redis import RedisCache

__all__ = ["DjangoRedisBackend", "RedisBackend", "first_location", "in_line_reply"]


def first_location(alias: str) -> str:
    """The first server of ``alias``'s LOCATION (a list, or a string of them
    split at ``,`` or ``;`` as Django's and django-redis's caches split it),
    for messages."""
    caches_setting: dict[str, Any] = django_settings.CACHES
    location: str | list[str] = caches_setting[alias].get("LOCATION", "")
    if isinstance(location, str):
        return re.split("[;,]", location)[0]
    return str(next(iter(location), ""))


def in_line_reply(value: bytes, reply: int) -> tuple[Hold | None, float]:
    """``take_in_line``'s answer from ``ACQUIRE_IN_LINE``'s ``reply``."""
    return (value, 0.0) if reply == 1 else (None, -reply / 1000)


class RedisBackend(LockBackend):
    """Locks on the primary of a RedisCache alias (reads go to it too)."""

    kind = "Redis"
    async_client: ClassVar[str | None] = "django_tasklock.backends.redis.aio"
    cache: RedisCache

    #: The client package whose exceptions the cache raises (redis-py, or
    #: valkey-py, its fork), and the base class of its errors.
    client_exceptions = "redis.exceptions"
    client_error = "RedisError"

    def __init__(self, cache: RedisCache, alias: str, protocol: str = "auto") -> None:
        super().__init__(cache, alias, protocol)
        self.records = self.uptime = self.scripts = self.items = self.lines = self
        exceptions = importlib.import_module(self.client_exceptions)
        self.errors = (getattr(exceptions, self.client_error), OSError)
        self._no_script = exceptions.NoScriptError
        self._dropped = (exceptions.ConnectionError, exceptions.TimeoutError)
        self._cache_client: Any = self._client_of(cache)
        self._primary: Any = None

    @staticmethod
    def _client_of(cache: Any) -> Any:
        """The cache's client object: connections, serializer."""
        return django_cache_client(cache)

    def key_for(self, lock_id: str) -> str:
        return encodable_key(self.cache, lock_id)

    def _redis(self, key: str) -> Any:
        # write=True: the primary, never a replica that may lag behind. Django
        # builds a new redis.Redis (its response-callback table and all) on every
        # get_client() call; one over the same connection pool serves this
        # backend's thread as well, at a fraction of the cost per lock.
        primary = self._primary
        if primary is None:
            # One of our own, over the same servers: timeouts of ours.
            primary = self._primary = own_client(self._connect(key), self._connected)
        return primary

    def _connect(self, key: str) -> Any:
        return self._cache_client.get_client(key, write=True)

    #: Called with each connection a cluster client makes (``own_client``).
    _connected: Callable[[Any], object] | None = None

    def _encode(self, token: str) -> bytes:
        encoded: bytes = self._serializer.dumps(token)
        return encoded

    def _decode(self, raw: bytes) -> object:
        return self._serializer.loads(raw)

    @functools.cached_property
    def _serializer(self) -> Any:
        return redis_serializer(self._cache_client)

    def _server(self) -> str:
        return first_location(self.alias)

    def describe(self, key: str) -> str:
        return f"{self.kind} cache {self.alias!r} at {self._server()}"

    def close(self) -> None:
        primary, self._primary = self._primary, None
        if primary is not None:
            close_own(primary)

    def _script(self, script: Script, keys: tuple[str, ...], *args: object) -> Any:
        client = self._redis(keys[0])
        try:
            return client.evalsha(script.sha, len(keys), *keys, *args)
        except self._no_script:
            # Not (or no longer: a restart, a failover, SCRIPT FLUSH) on that
            # server: sent whole, the same script runs, owner checks and all.
            return client.eval(script.text, len(keys), *keys, *args)

    def script(self, text: str, keys: tuple[str, ...], *args: object) -> Any:
        """Run the Lua script ``text`` (by its SHA once Redis has it) on the
        primary: how other parts of the package (rate limits) run their own
        atomic steps."""
        return self._script(script_of(text), keys, *args)

    def raw(self, key: str) -> bytes | None:
        """The bytes stored at ``key``, as a script wrote them (no serializer)."""
        value: bytes | None = self._redis(key).get(key)
        return value

    # Liveness records and listings: on the primary too, never a replica
    # (RedisCache reads from a random one of several LOCATIONs).

    def record_places(self) -> list[object]:
        return [ONE_PLACE]

    def record_place(self, key: str) -> object:
        return ONE_PLACE

    def write_record(self, place: object, record_id: str, value: str, ttl: int) -> None:
        key = self.key_for(record_id)
        self._redis(key).set(key, self._encode(value), ex=ttl)

    def read_record(self, key: str, record_id: str) -> object | None:
        record_key = self.key_for(record_id)
        raw = self._redis(record_key).get(record_key)
        return None if raw is None else self._decode(raw)

    def delete_record(self, place: object, record_id: str) -> None:
        key = self.key_for(record_id)
        self._redis(key).delete(key)

    def uptimes(self) -> dict[str, float]:
        info = self._redis("").info("server")
        return {self._server(): float(info["uptime_in_seconds"])}

    def _mget(self, keys: list[str]) -> list[Any]:
        """The values at the store keys ``keys``, in order: one MGET on the
        primary."""
        values: list[Any] = self._redis(keys[0]).mget(keys)
        return values

    # Plain writes (rosters, listings): on our own client too.

    def add(self, key: str, value: str, timeout: int) -> bool:
        made = self.key_for(key)
        return bool(
            self._redis(made).set(made, self._encode(value), ex=timeout, nx=True)
        )

    def write_many(self, items: dict[str, str], timeout: int) -> None:
        pipe = self._redis("").pipeline()
        for key, value in items.items():
            pipe.set(self.key_for(key), self._encode(value), ex=timeout)
        pipe.execute()  # (on a cluster: a round trip per primary)

    def delete_many(self, keys: list[str]) -> None:
        pipe = self._redis("").pipeline()
        for key in keys:
            pipe.delete(self.key_for(key))
        pipe.execute()

    def read_many(self, keys: list[str]) -> dict[str, Any]:
        if not keys:
            return {}
        made = [self.key_for(key) for key in keys]
        values = self._mget(made)
        return {
            key: self._decode(raw)
            for key, raw in zip(keys, values, strict=True)
            if raw is not None
        }

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        # The token goes through the cache's serializer, so cache.get(lock_id)
        # reads the owner back as a str.
        value = self._encode(token)
        milliseconds = math.ceil(expire * 1000)
        try:
            taken = self._script(ACQUIRE, (key,), value, milliseconds)
        except self._dropped:
            # The script may have run with its reply lost; once more, with the
            # same token, finds the lock ours if it did. A second failure is an
            # outage (and the token is removed once the store answers).
            taken = self._script(ACQUIRE, (key,), value, milliseconds)
        return value if taken else None

    # -- the waiting line (KeepsLines; the scripts keep it) --

    def take_in_line(
        self, key: str, token: str, expire: float, waiter: str, mark: float
    ) -> tuple[Hold | None, float]:
        value = self._encode(token)
        args = (value, math.ceil(expire * 1000), waiter, math.ceil(mark * 1000))
        try:
            reply = self._script(ACQUIRE_IN_LINE, (key,), *args)
        except self._dropped:  # (as acquire: the same token finds it ours)
            reply = self._script(ACQUIRE_IN_LINE, (key,), *args)
        return in_line_reply(value, reply)

    def wait_turn(self, key: str, waiter: str, timeout: float) -> bool:
        return self._redis(key).blpop([wake_key(key, waiter)], timeout) is not None

    def leave_line(self, key: str, waiter: str) -> None:
        self._script(LEAVE_LINE, (key,), waiter)

    #: (KeepsLines) ACQUIRE refuses a free lock while a waiter has the turn.
    guards_takes = True
    #: (KeepsLines) A blocking pop per waiter: not for an event loop's many.
    wakes_async = False

    def draw_fence(
        self, key: str, hold: Hold, token: str, fence: FenceCounter
    ) -> int | None:
        drawn = self._script(FENCE, (key, fence.key), hold, fence.floor, fence.ttl)
        return None if drawn is None else int(drawn)

    def release(self, key: str, hold: Hold, token: object) -> bool:
        return bool(self._script(RELEASE, (key,), hold))

    def discard(self, key: str, token: str) -> bool:
        return bool(self._script(RELEASE, (key,), self._encode(token)))

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        if self._script(EXTEND, (key,), hold, math.ceil(expire * 1000)):
            return hold
        return None

    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        value = self._encode(new)
        if self._script(REPLACE, (key,), hold, value, math.ceil(expire * 1000)):
            return value
        return None

    def take_over(
        self, key: str, expected: str, token: str, expire: float
    ) -> Hold | None:
        # One round trip, comparing the stored bytes with the mark as this
        # process encodes it. Refused, it compares the decoded value (a
        # publisher whose serializer wrote other bytes for the same str).
        value = self._encode(token)
        milliseconds = math.ceil(expire * 1000)
        arguments = (self._encode(expected), value, milliseconds)
        if self._script(TAKE_OVER, (key,), *arguments):
            return value
        return super().take_over(key, expected, token, expire)

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        return bool(self._redis(key).get(key) == hold)

    def locked(self, key: str) -> bool:
        return bool(self._redis(key).exists(key))

    def held_many(self, keys: list[str]) -> list[bool]:
        return [raw is not None for raw in self._mget(keys)]  # (none unpickled)

    def values_many(self, keys: list[str]) -> list[object | None]:
        return [None if raw is None else self._decode(raw) for raw in self._mget(keys)]

    def ttl(self, key: str) -> float | None:
        milliseconds = self._redis(key).pttl(key)
        if milliseconds == -2:
            return None
        return float("inf") if milliseconds < 0 else milliseconds / 1000

    def peek(self, key: str) -> Peek | None:
        raw = self._redis(key).get(key)
        if raw is None:
            return None
        return Peek(self._decode(raw), raw)

    def last_fence(self, key: str, fence_key: str) -> int | None:
        value = self._redis(key).get(fence_key)
        return None if value is None else int(value)


class DjangoRedisBackend(RedisBackend):
    """Locks on a django-redis cache (``django_redis.cache.RedisCache``).

    Its client's ``get_client(write=True)`` is the primary: the first LOCATION
    of a replicated setup, or the primary Sentinel names at connection time
    (redis-py's Sentinel pool asks again after a failover). Values go through
    the client's own serializer and compressor.
    """

    #: The clients (CLIENT_CLASS, the default first) that keep a lock and its
    #: fencing counter on one primary, and why another cannot hold locks.
    clients: ClassVar[tuple[str, ...]] = (
        "django_redis.client.DefaultClient",
        "django_redis.client.default.DefaultClient",
        "django_redis.client.SentinelClient",
        "django_redis.client.sentinel.SentinelClient",
    )
    other_client: ClassVar[str] = (
        "django-redis with CLIENT_CLASS {client!r}: only its DefaultClient (one "
        "server, or a primary with replicas) and SentinelClient keep a lock and "
        "its fencing counter on one primary (ShardClient spreads them over "
        "servers; HerdClient rewrites stored values). Give locks an alias with "
        "one of those two"
    )

    @classmethod
    def refusal(cls, options: dict[str, Any]) -> str | None:
        client = options.get("CLIENT_CLASS", cls.clients[0])
        return None if client in cls.clients else cls.other_client.format(client=client)

    @staticmethod
    def _client_of(cache: Any) -> Any:
        return cache.client

    def _connect(self, key: str) -> Any:
        return self._cache_client.get_client(write=True)

    def _encode(self, token: str) -> bytes:
        encoded: bytes = self._cache_client.encode(token)  # a str: never an int
        return encoded

    def _decode(self, raw: bytes) -> object:
        return self._cache_client.decode(raw)
