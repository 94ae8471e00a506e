"""The ``with`` and ``async with`` statements shared by ``Lock`` and ``Semaphore``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from ..exceptions import LockNotAcquired
from .fencing import FENCES_WANTED, holders, push_holder

if TYPE_CHECKING:
    from contextvars import Token
    from types import TracebackType

__all__ = ["Holding"]

_Holder = TypeVar("_Holder", bound="Holding")


class Holding:
    """The ``with`` and ``async with`` statements of Lock and Semaphore:
    acquire without waiting or raise ``LockNotAcquired``; release quietly on
    the way out. Inside the block, fenced writes (``django_tasklock.fenced``)
    carry this holder's fence."""

    lock_id: str
    #: Ends this holder's turn as the one fenced writes find (its block's end).
    _fence_reset: Token[Any] | None = None

    if TYPE_CHECKING:  # each class's own (Lock's in a mixin after this one)

        async def aacquire(
            self, *, blocking: bool = False, timeout: float | None = None
        ) -> bool: ...

        async def arelease_quietly(self) -> None: ...

    def acquire(self, *, blocking: bool = False, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def release_quietly(self) -> None:
        raise NotImplementedError

    def held_fence(self) -> int:
        raise NotImplementedError

    def __enter__(self: _Holder) -> _Holder:
        if not self.acquire():
            raise LockNotAcquired(self.lock_id)
        if FENCES_WANTED[0]:
            self._fence_reset = push_holder(self)
        return self

    def _end_fencing(self) -> None:
        reset, self._fence_reset = self._fence_reset, None
        if reset is not None:
            holders.reset(reset)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end_fencing()
        self.release_quietly()

    async def __aenter__(self: _Holder) -> _Holder:
        if not await self.aacquire():
            raise LockNotAcquired(self.lock_id)
        if FENCES_WANTED[0]:
            self._fence_reset = push_holder(self)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end_fencing()
        await self.arelease_quietly()
