"""``memcache_lock``: the Task Cookbook's context manager, made safe."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .fencing import held, holders
from .lock import Lock

if TYPE_CHECKING:
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
        # Written out, not a call of _fencing: the hot path of the recipe.
        lock = self.lock
        if not lock.acquire():
            return False
        lock._fence_reset = holders.set((*holders.get(), (lock, (), len(held.get()))))
        return True

    async def __aenter__(self) -> bool:
        return self._fencing(await self.lock.aacquire())

    def _fencing(self, acquired: bool) -> bool:
        """A taken lock is the one fenced writes in the block find."""
        if acquired:
            lock = self.lock
            lock._fence_reset = holders.set(
                (*holders.get(), (lock, (), len(held.get())))
            )
        return acquired

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.lock._end_fencing()
        await self.lock.arelease_quietly()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lock = self.lock
        reset = lock._fence_reset
        if reset is not None:
            lock._fence_reset = None
            holders.reset(reset)
        lock.release_quietly()
