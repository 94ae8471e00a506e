"""Stores without an async client of their own: the sync backend, in a thread.

Each call runs on a thread of the loop's default executor, over that thread's
own sync backend (``backend_for``), so the loop never waits on the store. An
owner check works from any thread: a hold taken in one is released in another
by its token, as a renewing lock's heartbeat does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import AsyncBackend

if TYPE_CHECKING:
    from ..base import Hold

__all__ = ["ThreadedBackend"]


class ThreadedBackend(AsyncBackend):
    """The sync backend of ``sync``'s alias and protocol, per executor thread."""

    native = False

    async def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        return await self.in_thread(lambda backend: backend.acquire(key, token, expire))

    async def release(self, key: str, hold: Hold, token: object) -> bool:
        return await self.in_thread(lambda backend: backend.release(key, hold, token))

    async def held_many(self, keys: list[str]) -> list[bool]:
        return await self.in_thread(lambda backend: backend.held_many(keys))
