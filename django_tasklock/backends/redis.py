"""Owner-checked locks on Django's RedisCache: SET NX PX, and compare-then-act
Lua scripts, which Redis runs atomically."""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any, cast

from ..keys import encodable_key
from .base import Acquired, FenceCounter, Hold, LockBackend, Peek

if TYPE_CHECKING:
    from django.core.cache.backends.redis import RedisCache

__all__ = ["RedisBackend"]

# Take the lock and draw its fencing token in one atomic step; a missing counter
# starts again from the floor (ARGV[3], the clock in microseconds).
_ACQUIRE = """
local last = redis.call("get", KEYS[2])
if last and not tonumber(last) then
    return redis.error_reply("the fencing counter " .. KEYS[2] .. " holds something "
        .. "that is not a number; some other code wrote to that key. Delete it (it "
        .. "restarts from the clock); the lock was not taken")
end
if not redis.call("set", KEYS[1], ARGV[1], "NX", "PX", ARGV[2]) then
    return false
end
local fence
if last then
    fence = redis.call("incr", KEYS[2])
else
    redis.call("set", KEYS[2], ARGV[3])
    fence = tonumber(ARGV[3])
end
redis.call("expire", KEYS[2], ARGV[4])
return fence
"""
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
    script: hashlib.sha1(script.encode()).hexdigest()
    for script in (_ACQUIRE, _RELEASE, _EXTEND)
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

    def close(self) -> None:
        # RedisCache.close() leaves its connection pools open.
        for pool in getattr(self._cache_client, "_pools", {}).values():
            pool.disconnect()

    def _script(self, script: str, keys: tuple[str, ...], *args: object) -> Any:
        import redis

        client = self._redis(keys[0])
        try:
            return client.evalsha(_SHA[script], len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            return client.eval(script, len(keys), *keys, *args)

    def acquire(
        self, key: str, token: str, expire: float, fence: FenceCounter
    ) -> Acquired | None:
        # The token goes through the cache's serializer, so cache.get(lock_id)
        # reads the owner back as a str.
        value: bytes = self._cache_client._serializer.dumps(token)
        drawn = self._script(
            _ACQUIRE,
            (key, fence.key),
            value,
            math.ceil(expire * 1000),
            fence.floor,
            fence.ttl,
        )
        return None if drawn is None else Acquired(value, int(drawn))

    def release(self, key: str, hold: Hold, token: object) -> bool:
        return bool(self._script(_RELEASE, (key,), hold))

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        if self._script(_EXTEND, (key,), hold, math.ceil(expire * 1000)):
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

    def peek(self, key: str) -> Peek | None:
        raw = self._redis(key).get(key)
        if raw is None:
            return None
        return Peek(self._cache_client._serializer.loads(raw), raw)

    def last_fence(self, key: str, fence_key: str) -> int | None:
        value = self._redis(key).get(fence_key)
        return None if value is None else int(value)
