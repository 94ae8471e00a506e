"""The ``with`` and ``async with`` statements shared by ``Lock`` and ``Semaphore``."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from ..exceptions import LockNotAcquired

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["Holding"]

_Holder = TypeVar("_Holder", bound="Holding")


class Holding:
    """The ``with`` and ``async with`` statements of Lock and Semaphore:
    acquire without waiting or raise ``LockNotAcquired``; release quietly on
    the way out."""

    lock_id: str

    if TYPE_CHECKING:  # each class's own (Lock's in a mixin after this one)

        async def aacquire(
            self, *, blocking: bool = False, timeout: float | None = None
        ) -> bool: ...

        async def arelease_quietly(self) -> None: ...

    def acquire(self, *, blocking: bool = False, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def release_quietly(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Holder) -> _Holder:
        if not self.acquire():
            raise LockNotAcquired(self.lock_id)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release_quietly()

    async def __aenter__(self: _Holder) -> _Holder:
        if not await self.aacquire():
            raise LockNotAcquired(self.lock_id)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.arelease_quietly()
