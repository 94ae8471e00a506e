"""Owner-checked locks on Django's RedisCache: SET NX PX, and compare-then-act
Lua scripts, which Redis runs atomically."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, cast

from ..keys import encodable_key
from .base import Hold, LockBackend

if TYPE_CHECKING:
    from django.core.cache.backends.redis import RedisCache

__all__ = ["RedisBackend"]

_RELEASE = """
if redis.call("get", KEYS[1]) == ARGV[1] then
    return redis.call("del", KEYS[1])
end
return 0
"""
_EXTEND = """
if redis.call("get", KEYS[1]) == ARGV[1] then
    return redis.call("pexpire", KEYS[1], ARGV[2])
end
return 0
"""
_SHA = {
    script: hashlib.sha1(script.encode()).hexdigest() for script in (_RELEASE, _EXTEND)
}


def _redis_errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, OSError)


class RedisBackend(LockBackend):
    """Locks on the primary of a RedisCache alias (reads go to it too)."""

    kind = "Redis"
    cache: RedisCache

    def __init__(self, cache: RedisCache, alias: str) -> None:
        super().__init__(cache, alias)
        self.errors = _redis_errors()
        self._cache_client: Any = cache._cache

    def key_for(self, lock_id: str) -> str:
        return encodable_key(self.cache, lock_id)

    def _redis(self, key: str) -> Any:
        # write=True: the primary, never a replica that may lag behind.
        return self._cache_client.get_client(key, write=True)

    def describe(self, key: str) -> str:
        return f"Redis cache {self.alias!r} at {cast(Any, self.cache)._servers[0]}"

    def _script(self, script: str, key: str, *args: object) -> Any:
        import redis

        client = self._redis(key)
        try:
            return client.evalsha(_SHA[script], 1, key, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(script, 1, key, *args)

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        # The token goes through the cache's serializer, so cache.get(lock_id)
        # reads the owner back as a str.
        value: bytes = self._cache_client._serializer.dumps(token)
        if self._redis(key).set(key, value, nx=True, px=math.ceil(expire * 1000)):
            return value
        return None

    def release(self, key: str, hold: Hold, token: str) -> bool:
        return bool(self._script(_RELEASE, key, hold))

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        if self._script(_EXTEND, key, hold, math.ceil(expire * 1000)):
            return hold
        return None

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        return bool(self._redis(key).get(key) == hold)

    def locked(self, key: str) -> bool:
        return bool(self._redis(key).exists(key))

    def ttl(self, key: str) -> float | None:
        milliseconds = self._redis(key).pttl(key)
        if milliseconds == -2:
            return None
        return float("inf") if milliseconds < 0 else milliseconds / 1000
