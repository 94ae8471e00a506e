"""``memcache_lock``: the Task Cookbook's context manager, made safe."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .fencing import FENCES_WANTED, held, holders, push_holder
from .lock import Lock

if TYPE_CHECKING:
    from contextvars import Token
    from types import TracebackType

__all__ = ["memcache_lock"]


class memcache_lock:
    """The cookbook's ``memcache_lock``, made safe; yields True if the lock was taken.

    ::

        with memcache_lock(lock_id, self.app.oid) as acquired:
            if acquired:
                return Feed.objects.import_feed(feed_url).url
        logger.info("Feed %s is already being imported by another worker", feed_url)

    Unlike the recipe, it releases on exit only a lock this call took and still
    owns (never one that expired and was taken by someone else), and a store that
    cannot be reached raises ``LockBackendError`` instead of looking like
    contention. ``expire``, ``cache`` and ``renew`` default to ``TASKLOCK``; ``oid``
    is kept in the stored value for people reading the store. The Lock is
    ``.lock``: ``cm = memcache_lock(...)``, then ``cm.lock.fence`` in the block.

    ``async with memcache_lock(...) as acquired:`` does the same from an event
    loop, without blocking it (``Lock.aacquire``).
    """

    #: Ends the lock's turn as the one fenced writes in the block find.
    _fencing: Token[Any] | None = None

    def __init__(
        self,
        lock_id: str,
        oid: str | None = None,
        *,
        expire: float | None = None,
        cache: str | None = None,
        renew: bool | None = None,
        max_hold: float | None = None,
    ) -> None:
        #: The Lock underneath, for its ``fence`` and ``lost`` inside the block.
        self.lock = Lock(
            lock_id,
            expire=expire,
            cache=cache,
            oid=oid,
            renew=renew,
            max_hold=max_hold,
        )

    def __enter__(self) -> bool:
        # Written out, not a call of push_holder: the hot path of the recipe.
        lock = self.lock
        if not lock.acquire():
            return False
        if FENCES_WANTED[0]:
            self._fencing = holders.set((lock, (), held.get(), holders.get()))
        return True

    async def __aenter__(self) -> bool:
        if not await self.lock.aacquire():
            return False
        if FENCES_WANTED[0]:
            self._fencing = push_holder(self.lock)
        return True

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end_fencing()
        await self.lock.arelease_quietly()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        reset = self._fencing
        if reset is not None:
            self._fencing = None
            holders.reset(reset)
        self.lock.release_quietly()

    def _end_fencing(self) -> None:
        reset, self._fencing = self._fencing, None
        if reset is not None:
            holders.reset(reset)
