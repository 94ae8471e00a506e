"""A blocking acquire's place in its lock's waiting line.

Where the store keeps lines (``backend.lines``: Redis, standalone and
cluster; memcached, ``backends.memcached.line``) and ``TASKLOCK["WAITING"]``
is ``"line"``, a blocking acquire that was refused joins the lock's line and
blocks until the release wakes it, instead of polling: the next holder starts
a round trip after the release (on memcached, which cannot notify another
process, within its turn's poll), not up to half a second later, and the
waiters take the lock in the order they came, so none starves while others
take it again and again (a holder that takes it again at once joins the end
of the line). Where a plain take cannot look at the line (memcached), a
blocking acquire starts in it.

What the line costs when a wake-up is lost (its waiter's connection dropped,
the line flushed or failed over with the lock): a waiter tries again at the
latest ``LONGEST`` after its last try, or when the lock it waits for would
expire, and a waiter that died keeps its turn until its mark expires
(``MARK`` after its last try), then is passed over. Neither is ever a hang:
every waiter also ends by its own timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import TYPE_CHECKING, Final

from ..backends.aio.finishing import finish_later
from ..backends.capabilities import WAITING_HERE, wait_here, wake_here
from ..conf import settings

if TYPE_CHECKING:
    from ..backends import LockBackend
    from ..backends.aio.base import AsyncBackend, Cancel
    from ..backends.capabilities import Hold, KeepsLines

__all__ = [
    "LONGEST",
    "MARK",
    "WAITING_HERE",
    "AsyncPlace",
    "Place",
    "aleft_line",
    "async_place_for",
    "first_place",
    "left_line",
    "place_for",
    "turn_wait",
    "wait_here",
    "wake_here",
]

#: How long a waiter's mark lasts after each of its tries: a waiter that
#: died holds up the line at most this long.
MARK: Final = 2.0
#: Any failure of a leave, which only hastens the next waiter's turn.
_ANY: Final = (Exception,)
#: The longest a waiter in line blocks between two tries: what a lost wake-up
#: costs at most.
LONGEST: Final = 0.5


def turn_wait(hint: float, deadline: float | None, now: float) -> float | None:
    """How long a waiter in line blocks before its next try, told to wait at
    most ``hint`` seconds: never past ``deadline``, ``LONGEST`` nor half the
    store's reply timeout (the blocking read must answer before it); None
    once the deadline has passed."""
    if deadline is not None and now >= deadline:
        return None
    wait = min(hint, LONGEST, settings.SOCKET_TIMEOUT / 2)
    return wait if deadline is None else min(wait, deadline - now)


class Place:
    """A waiter's place in the line of the lock at ``key``: its id, and how
    long its last try said to wait."""

    __slots__ = ("errors", "hint", "key", "lines", "waiter")

    def __init__(
        self, lines: KeepsLines, key: str, errors: tuple[type[BaseException], ...]
    ) -> None:
        self.lines, self.key, self.errors = lines, key, errors
        self.waiter = secrets.token_hex(8)
        self.hint = 0.0

    def take(self, token: str, expire: float) -> Hold | None:
        """A try in line: the hold if taken, else None (in line)."""
        hold, self.hint = self.lines.take_in_line(
            self.key, token, expire, self.waiter, MARK
        )
        return hold

    def wait(self, deadline: float | None) -> bool:
        """Block until woken or the next try is due; False (at once) once
        ``deadline`` has passed."""
        wait = turn_wait(self.hint, deadline, time.monotonic())
        if wait is None:
            return False
        if wait > 0:
            try:
                self.lines.wait_turn(self.key, self.waiter, wait)
            except self.errors:  # waited out; the next try meets the store,
                time.sleep(wait)  # and says if it is down
            except BaseException:  # interrupted: its turn handed on now,
                self.leave(_ANY)  # not at its mark's end
                raise
        return True

    def leave(self, errors: tuple[type[BaseException], ...] | None = None) -> None:
        """Out of the line (the acquire gave up or failed); a store that
        cannot be reached (``errors``, by default the store's) leaves the
        mark to expire."""
        errors = self.errors if errors is None else errors
        with contextlib.suppress(*errors):
            self.lines.leave_line(self.key, self.waiter)


def left_line(place: Place | None) -> None:
    """``place`` out of its line, if the acquire had one."""
    if place is not None:
        place.leave()


def place_for(
    backend: LockBackend,
    key: str,
    blocking: bool,
    take_over: object = None,
    first: bool = False,
) -> Place | None:
    """A place in the line of the lock at ``key`` for a blocking acquire on a
    store that keeps lines, unless ``WAITING`` is ``"poll"``; else None. A
    take-over (``take_over``: a queued call's) is no newcomer and waits its
    own way. Before the ``first`` try, only where a plain take cannot look
    at the line (``KeepsLines.guards_takes``)."""
    lines = backend.lines
    if not blocking or take_over or lines is None or settings.WAITING != "line":
        return None
    if first and lines.guards_takes:
        return None
    return Place(lines, key, backend.errors)


def first_place(backend: LockBackend, key: str, take_over: object) -> Place | None:
    """``place_for`` a blocking acquire before its first try: a place only
    where a plain take cannot look at the line (``guards_takes``)."""
    return place_for(backend, key, True, take_over, first=True)


class AsyncPlace(Place):
    """A waiter's place in line for ``aacquire``: the same, over the loop's
    backend (``store``), its take carried through a cancel."""

    __slots__ = ("store",)

    def __init__(self, store: AsyncBackend, key: str) -> None:
        super().__init__(store.sync.lines, key, store.errors)  # type: ignore[arg-type]
        self.store = store

    async def atake(
        self, key: str, token: str, expire: float, cancel: Cancel | None
    ) -> Hold | None:
        """A try in line (``AsyncBackend.take``'s signature); cancelled, the
        waiter leaves the line after the try (on a pipelined connection, the
        leave is sent behind it)."""
        try:
            hold, self.hint = await self.store.take_in_line(
                key, token, expire, self.waiter, MARK, cancel
            )
        except asyncio.CancelledError:
            finish_later(self.aleave())
            raise
        return hold

    async def await_turn(self, deadline: float | None) -> None:
        """``wait``, awaited."""
        wait = turn_wait(self.hint, deadline, time.monotonic())
        if wait is not None and wait > 0:
            try:
                await self.store.wait_turn(self.key, self.waiter, wait)
            except self.errors:  # waited out; the next try meets the store,
                await asyncio.sleep(wait)  # and says if it is down
            except BaseException:  # cancelled
                finish_later(self.aleave())
                raise

    async def aleave(self) -> None:
        """``leave``, awaited."""
        with contextlib.suppress(*self.store.errors):
            await self.store.leave_line(self.key, self.waiter)


async def aleft_line(place: AsyncPlace | None) -> None:
    """``place`` out of its line, if the acquire had one."""
    if place is not None:
        await place.aleave()


def async_place_for(
    store: AsyncBackend, key: str, blocking: bool, first: bool = False
) -> AsyncPlace | None:
    """``place_for``, for ``aacquire`` over the loop's ``store``."""
    lines = store.sync.lines
    if not blocking or lines is None or settings.WAITING != "line":
        return None
    if not lines.wakes_async:
        return None
    return None if first and lines.guards_takes else AsyncPlace(store, key)
