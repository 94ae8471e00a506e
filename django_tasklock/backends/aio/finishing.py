"""Work a cancelled caller leaves behind: a take or release that was sent
runs to its end, so the store's reply is never lost, and what a cancelled
take got is released after it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["carried_through", "finish_cancelled", "finish_later"]

_T = TypeVar("_T")

#: Work left to finish after its caller was cancelled (asyncio keeps only
#: weak references to tasks).
_finishing: set[asyncio.Future[Any]] = set()


async def carried_through(
    work: Awaitable[_T],
    if_cancelled: Callable[[_T], Awaitable[object]] | None = None,
    if_failed: Callable[[BaseException], object] | None = None,
) -> _T:
    """``work``'s result, run to its end even if the caller is cancelled: then
    ``if_cancelled(result)`` runs after it (a take's release), or, if it
    raised, ``if_failed(exception)`` (a take of unknown fate watched)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _finishing.add(task)

        def finished(done: asyncio.Future[_T]) -> None:
            _finishing.discard(done)
            if done.cancelled():
                return
            error = done.exception()
            if error is not None:
                if if_failed is not None:
                    if_failed(error)
                return
            if if_cancelled is None:
                return
            cleanup = asyncio.ensure_future(if_cancelled(done.result()))
            _finishing.add(cleanup)
            cleanup.add_done_callback(_finishing.discard)

        task.add_done_callback(finished)
        raise


async def finish_cancelled() -> None:
    """Wait for the takes and releases still running for callers that were
    cancelled (and the releases of what such takes got), on this loop."""
    loop = asyncio.get_running_loop()
    while mine := [task for task in _finishing if task.get_loop() is loop]:
        await asyncio.wait(mine)


def finish_later(work: Awaitable[object]) -> None:
    """Run ``work`` on the running loop for a caller that was cancelled (kept
    until done: ``finish_cancelled`` waits for it)."""
    task = asyncio.ensure_future(work)
    _finishing.add(task)
    task.add_done_callback(_finishing.discard)
