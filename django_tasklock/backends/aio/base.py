"""What an async lock backend does: the hot path of ``LockBackend``, awaited."""

from __future__ import annotations

import abc
import asyncio
import weakref
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from .. import _generation, backend_for
from .finishing import carried_through

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ..base import Hold, LockBackend, Peek

_T = TypeVar("_T")


__all__ = ["AsyncBackend", "Cancel", "PipelinedBackend"]


class Cancel(Protocol):
    """What a take does if its caller is cancelled once it was sent: the
    lock it took is released (``taken``); one whose fate is unknown (the
    connection failed first) is watched (``failed``)."""

    def taken(self, hold: Hold | None) -> Awaitable[object]: ...

    def failed(self, exc: BaseException) -> object: ...


class AsyncBackend(abc.ABC):
    """Take and release owner-checked locks of one cache alias from one event
    loop. ``sync`` is the loop thread's sync backend of the alias: its keys,
    its encoding, and what the rare paths (renewal, fencing, recovery) use.
    ``native``: whether the I/O is the loop's own (else a thread's)."""

    native: bool

    def __init__(self, sync: LockBackend) -> None:
        self.sync = sync
        self.alias = sync.alias
        #: The loop it serves (a weak reference: a loop whose connections were
        #: never closed is not kept alive by its backends) and the generation
        #: of CACHES it was built in: a holder's release reuses it while both
        #: still hold.
        self.loop = weakref.ref(asyncio.get_running_loop())
        self.generation = _generation[0]
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

    @abc.abstractmethod
    async def held_many(self, keys: list[str]) -> list[bool]:
        """For each key, whether anybody holds that lock (a hint: only a take
        decides)."""

    async def take(
        self,
        key: str,
        token: str,
        expire: float,
        cancel: Cancel | None,
    ) -> Hold | None:
        """``acquire``, carried through a cancel of its caller: then
        ``cancel.taken(hold)`` gets what it took, or ``cancel.failed(error)``
        a take whose fate is unknown."""
        work = self.acquire(key, token, expire)
        if cancel is None:
            return await carried_through(work)
        return await carried_through(work, cancel.taken, cancel.failed)

    async def drop(self, key: str, hold: Hold, token: object) -> bool:
        """``release``, carried to its end through a cancel of its caller."""
        return await carried_through(self.release(key, hold, token))

    # The waiting line (``KeepsLines``, where ``sync.lines`` is not None): the
    # sync backend's on an executor thread, unless a store's class has its own.

    async def take_in_line(
        self,
        key: str,
        token: str,
        expire: float,
        waiter: str,
        mark: float,
        cancel: Cancel | None,
    ) -> tuple[Hold | None, float]:
        """``KeepsLines.take_in_line``, carried through a cancel as ``take``."""

        def work(backend: LockBackend) -> tuple[Hold | None, float]:
            assert backend.lines is not None, f"{backend.kind} keeps no lines"
            return backend.lines.take_in_line(key, token, expire, waiter, mark)

        taking = self.in_thread(work)
        if cancel is None:
            return await carried_through(taking)
        landed = cancel.taken

        async def let_go(got: tuple[Hold | None, float]) -> None:
            # Its caller was cancelled: what it took released, and the
            # waiter out of the line once the take has ended (not beside it).
            await landed(got[0])
            await self.leave_line(key, waiter)

        return await carried_through(taking, let_go, cancel.failed)

    async def wait_turn(self, key: str, waiter: str, timeout: float) -> bool:
        """``KeepsLines.wait_turn``, awaited."""

        def work(backend: LockBackend) -> bool:
            assert backend.lines is not None, f"{backend.kind} keeps no lines"
            return backend.lines.wait_turn(key, waiter, timeout)

        return await self.in_thread(work)

    async def leave_line(self, key: str, waiter: str) -> None:
        """``KeepsLines.leave_line``, carried to its end through a cancel."""

        def work(backend: LockBackend) -> None:
            assert backend.lines is not None, f"{backend.kind} keeps no lines"
            backend.lines.leave_line(key, waiter)

        await carried_through(self.in_thread(work))

    # What rate limits use (limits.store): native where a store's class says
    # so, else the sync backend's on an executor thread.

    async def peek(self, key: str) -> Peek | None:
        """What the store holds at ``key``, and a hold on that very item."""
        return await self.in_thread(lambda backend: backend.peek(key))

    async def replace(
        self, key: str, hold: Hold, old: object, new: str, expire: float
    ) -> Hold | None:
        """Store ``new`` in place of the item ``hold`` holds (value ``old``)
        only while it is still there; the new hold, or None."""
        return await self.in_thread(
            lambda backend: backend.replace(key, hold, old, new, expire)
        )

    async def script(self, text: str, keys: tuple[str, ...], *args: object) -> Any:
        """Run the Lua script ``text`` on the store (where it has ``scripts``)."""

        def run(backend: LockBackend) -> Any:
            assert backend.scripts is not None, f"{backend.kind} runs no scripts"
            return backend.scripts.script(text, keys, *args)

        return await self.in_thread(run)

    async def in_thread(self, work: Callable[[LockBackend], _T]) -> _T:
        """``work(backend)`` on an executor thread, over that thread's own sync
        backend of this alias and protocol."""
        alias, protocol = self.alias, self.sync.protocol
        return await asyncio.to_thread(
            lambda: work(backend_for(alias, protocol=protocol))
        )

    async def aclose(self) -> None:  # noqa: B027 - most have nothing of their own
        """Close the connections this backend opened."""


class PipelinedBackend(AsyncBackend):
    """A backend whose take and release keep a cancelled caller's reply on
    their connection (its reader hands it on), with no task of their own:
    ``take`` and ``drop`` are its own, and ``acquire`` and ``release`` are
    them, with nothing to do after a cancel."""

    async def acquire(self, key: str, token: str, expire: float) -> Hold | None:
        return await self.take(key, token, expire, None)

    async def release(self, key: str, hold: Hold, token: object) -> bool:
        return await self.drop(key, hold, token)
