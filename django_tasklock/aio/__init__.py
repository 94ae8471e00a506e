"""Async lock backends: one per cache alias and event loop.

A loop's backend talks to the store over connections of that loop (an
asyncio connection cannot serve two loops), made on first use and forgotten
with the loop (or when CACHES changes, or in a forked child). A store with a
client of its own for loops names it (``LockBackend.async_client``: memcached
with meta commands, Redis over one server); every other store is served by
its sync backend on the loop's executor threads (``backends.aio.threaded``).
"""

from __future__ import annotations

import asyncio
import importlib
import weakref
from typing import TYPE_CHECKING

from ..backends import _generation, backend_for
from ..backends.aio.finishing import finish_cancelled
from ..backends.aio.threaded import ThreadedBackend

if TYPE_CHECKING:
    from types import ModuleType

    from ..backends import LockBackend
    from ..backends.aio.base import AsyncBackend

__all__ = [
    "async_backend_for",
    "close_loop_connections",
    "loop_backend",
    "warm_backend",
]


class _LoopBackends(dict[tuple[str, str], "AsyncBackend"]):
    def __init__(self, generation: int) -> None:
        super().__init__()
        self.generation = generation


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopBackends] = (
    weakref.WeakKeyDictionary()
)


#: The loop asked for last (a weak reference) and its backends: most calls
#: come from the loop before, and find them with no weak dictionary's lookup.
#: One tuple, read and replaced whole: loops of other threads replace it too.
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], _LoopBackends] | None = None


def async_backend_for(alias: str, protocol: str) -> AsyncBackend:
    """The running loop's async backend of the CACHES entry ``alias``."""
    global _last
    loop = asyncio.get_running_loop()
    generation = _generation[0]
    last = _last
    if last is not None and last[0]() is loop and last[1].generation == generation:
        memo = last[1]
    else:
        memo = _per_loop.get(loop)  # type: ignore[assignment]
        if memo is None or memo.generation != generation:
            memo = _per_loop[loop] = _LoopBackends(generation)
        _last = (weakref.ref(loop), memo)
    backend = memo.get((alias, protocol))
    if backend is None:
        backend = memo[alias, protocol] = _build(alias, protocol)
    return backend


#: The (alias, protocol) pairs whose modules this process has imported.
_warmed: set[tuple[str, str]] = set()


async def loop_backend(alias: str, protocol: str) -> AsyncBackend:
    """``async_backend_for``, from a coroutine: the first time in a process,
    the modules the backend needs (the cache's client library, its async
    twin: ``redis.asyncio`` takes a tenth of a second to import) are
    imported on an executor thread, not on the loop."""
    if (alias, protocol) not in _warmed:
        await asyncio.to_thread(
            lambda: _native_kind(backend_for(alias, protocol=protocol))
        )
        _warmed.add((alias, protocol))
    return async_backend_for(alias, protocol)


#: The backend ``warm_backend`` gave last, with its alias and protocol (its
#: loop and generation of CACHES are its own). One tuple, read and replaced
#: whole, as ``_last``.
_last_warm: tuple[str, str, AsyncBackend] | None = None


def warm_backend(alias: str, protocol: str) -> AsyncBackend | None:
    """``loop_backend``'s answer with no coroutine of its own, once its modules
    are imported (the hot path of every take and release); None before."""
    global _last_warm
    last = _last_warm
    if last is not None and last[0] == alias and last[1] == protocol:
        backend = last[2]
        if (
            backend.loop() is asyncio.get_running_loop()
            and backend.generation == _generation[0]
        ):
            return backend
    if (alias, protocol) not in _warmed:
        return None
    backend = async_backend_for(alias, protocol)
    _last_warm = (alias, protocol, backend)
    return backend


def _native_kind(sync: LockBackend) -> ModuleType | None:
    """The module of the store's own client for loops (imported), or None
    for the threaded one."""
    module = sync.async_client
    return None if module is None else importlib.import_module(module)


def _build(alias: str, protocol: str) -> AsyncBackend:
    sync = backend_for(alias, protocol=protocol)
    native = _native_kind(sync)
    made: AsyncBackend | None = None if native is None else native.build(sync)
    return ThreadedBackend(sync) if made is None else made


async def close_loop_connections() -> None:
    """Close the connections django_tasklock opened for the running loop (call
    it before the loop ends, as ``asyncio.run``'s main coroutine's last step,
    to leave no socket behind). A later lock reconnects."""
    global _last, _last_warm
    await finish_cancelled()
    loop = asyncio.get_running_loop()
    memo = _per_loop.pop(loop, None)
    last = _last
    if last is not None and last[0]() is loop:
        _last = None
    warm = _last_warm
    if warm is not None and warm[2].loop() is loop:
        _last_warm = None
    for backend in (memo or {}).values():
        await backend.aclose()
