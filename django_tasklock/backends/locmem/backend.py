"""Locks in Django's LocMemCache: one process only, for tests and development."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from ...foreign import locmem_deadline
from ...keys import portable_id
from ..base import FenceCounter, Hold, LockBackend, Peek
from ..capabilities import CacheRecords

if TYPE_CHECKING:
    from django.core.cache.backends.locmem import LocMemCache

__all__ = ["LocMemBackend"]

# LocMemCache's own lock is not reentrant and private; one of ours per alias makes
# the get-compare-delete below atomic against every other Lock in this process,
# while cache.add stays atomic against the recipe's cache.add.
_guards: dict[str, threading.Lock] = {}
_guards_lock = threading.Lock()


def _guard(alias: str) -> threading.Lock:
    with _guards_lock:
        return _guards.setdefault(alias, threading.Lock())


class LocMemBackend(LockBackend):
    """Owner-checked locks on LocMemCache, valid within one process only."""

    kind = "LocMem"
    errors = (ValueError,)
    cache: LocMemCache

    def __init__(self, cache: LocMemCache, alias: str, protocol: str = "auto") -> None:
        super().__init__(cache, alias, protocol)
        self.records = CacheRecords(cache)

    def key_for(self, lock_id: str) -> str:
        # The cache API applies make_key itself; hash the ids memcached would
        # refuse so that tests on LocMem see the keys production sees.
        return portable_id(self.cache, lock_id)

    def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        return token if self.cache.add(key, token, expire) else None

    def draw_fence(
        self, key: str, hold: Hold, token: str, fence: FenceCounter
    ) -> int | None:
        with _guard(self.alias):
            if self.cache.get(key) != hold:
                return None
            last = self.cache.get(fence.key)
            if last is not None and not isinstance(last, int):
                raise ValueError(
                    f"the fencing counter {fence.key!r} holds {last!r}, not a number; "
                    "some other code wrote to that key. Delete it (it restarts from "
                    "the clock); no fence was drawn, and the lock is still held"
                )
            drawn = fence.floor if last is None else last + 1
            self.cache.set(fence.key, drawn, fence.ttl)
            return drawn

    def release(self, key: str, hold: Hold, token: object) -> bool:
        with _guard(self.alias):
            if self.cache.get(key) != hold:
                return False
            return bool(self.cache.delete(key))

    def discard(self, key: str, token: str) -> bool:
        return self.release(key, token, token)

    def extend(self, key: str, hold: Hold, token: str, expire: float) -> Hold | None:
        with _guard(self.alias):
            if self.cache.get(key) != hold:
                return None
            self.cache.set(key, token, expire)
            return hold

    def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        with _guard(self.alias):
            if self.cache.get(key) != hold:
                return None
            self.cache.set(key, new, expire)
            return new

    def owned(self, key: str, hold: Hold, token: str) -> bool:
        return bool(self.cache.get(key) == hold)

    def locked(self, key: str) -> bool:
        return self.cache.has_key(key)

    def values_many(self, keys: list[str]) -> list[object | None]:
        return [self.cache.get(key) for key in keys]

    def ttl(self, key: str) -> float | None:
        if not self.cache.has_key(key):
            return None
        # LocMemCache keeps wall-clock deadlines (None: never) beside the values.
        deadline = locmem_deadline(self.cache, self.cache.make_key(key))
        return float("inf") if deadline is None else max(0.0, deadline - time.time())

    def peek(self, key: str) -> Peek | None:
        value = self.cache.get(key)
        return None if value is None else Peek(value, value)

    def last_fence(self, key: str, fence_key: str) -> int | None:
        value = self.cache.get(fence_key)
        return None if value is None else int(value)
