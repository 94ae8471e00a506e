"""What an async lock backend does: the hot path of ``LockBackend``, awaited."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from .finishing import carried_through

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..backends import Hold, LockBackend


__all__ = ["AsyncBackend"]


class AsyncBackend(abc.ABC):
    """Take and release owner-checked locks of one cache alias from one event
    loop. ``sync`` is the loop thread's sync backend of the alias: its keys,
    its encoding, and what the rare paths (renewal, fencing, recovery) use.
    ``native``: whether the I/O is the loop's own (else a thread's)."""

    native: bool

    def __init__(self, sync: LockBackend) -> None:
        self.sync = sync
        self.alias = sync.alias
        self.errors: tuple[type[BaseException], ...] = sync.errors
        #: key -> when this loop may next look at who holds that lock
        #: (``locks.recovery``; monotonic).
        self.looks: dict[str, float] = {}

    @abc.abstractmethod
    async def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        """Take the lock if nobody holds it: the hold, or None if it is held."""

    @abc.abstractmethod
    async def release(self, key: str, hold: Hold, token: object) -> bool:
        """Remove the lock only if ``hold`` still owns it; True if removed."""

    async def take(
        self,
        key: str,
        token: str,
        expire: float,
        if_cancelled: Callable[[Hold | None], Awaitable[object]] | None,
        if_failed: Callable[[BaseException], object] | None,
    ) -> Hold | None:
        """``acquire``, carried through a cancel of its caller: then
        ``if_cancelled(hold)`` gets what it took, or ``if_failed(error)`` a
        take whose fate is unknown."""
        return await carried_through(
            self.acquire(key, token, expire), if_cancelled, if_failed
        )

    async def drop(self, key: str, hold: Hold, token: object) -> bool:
        """``release``, carried to its end through a cancel of its caller."""
        return await carried_through(self.release(key, hold, token))

    async def aclose(self) -> None:  # noqa: B027 - most have nothing of their own
        """Close the connections this backend opened."""
