"""``Lock``'s async twins: ``await lock.aacquire()``, ``async with lock``.

The same lock, tokens, owner checks, errors and signals as the sync methods;
the store's round trips of a take and a release are the event loop's own
(``aio``: ``redis.asyncio``, an asyncio memcached client), and a wait between
tries is an ``asyncio.sleep``. What is rare runs on the loop's executor
threads, over their own sync backends: a look at a refused lock's holder
(crash recovery), the first liveness record, an extend, a fence. A renewing
lock's heartbeat is the sync one's thread.

Cancellation: a take or a release in flight is carried to its end (shielded),
so the store's reply is never lost. A task cancelled while a take is in
flight releases what the take got, owner-checked; one cancelled inside
``async with`` releases on the way out. A release that cannot be sent leaves
the lock to expire, or to crash recovery when its holder's process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from ..aio import loop_backend, warm_backend
from ..backends import _generation, backend_for, fork_generation
from ..backends.aio.finishing import carried_through
from ..conf import validate_expire
from ..exceptions import LockBackendError
from ..signals import lock_released
from ..tokens import new_live_token, new_token
from .acquisition import Acquisition
from .fencing import draw_fence
from .holds import extend_hold
from .line import WAITING_HERE, AsyncPlace, aleft_line, async_place_for, wake_here
from .liveness import record_beside
from .loss import report_lost, take_failed
from .recovery import LOOK_EVERY, take_from_dead
from .taking import (
    after_refusal,
    hold_taken,
    release_error,
    take_settings,
)
from .validation import beat_for, require_hold
from .waiting import POLL_MIN

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from django.dispatch import Signal

    from ..backends import Hold, LockBackend
    from ..backends.aio.base import AsyncBackend, Cancel
    from .heartbeat import Heartbeat as HeartbeatType
    from .liveness import Record

__all__ = ["AsyncLocking"]

# The sync Lock's logger: a release's failure is logged under one name.
logger = logging.getLogger("django_tasklock.locks.lock")


class AsyncLocking:
    """The async methods of ``Lock`` (see there for what each promises)."""

    lock_id: str
    owner: str
    max_hold: float | None
    on_lost: Any
    _acq: Acquisition | None
    _expire: float | None
    _cache: str | None
    _renew_option: bool | None
    _take_over: str | None
    _guard: Any
    _heartbeat: HeartbeatType | None
    #: The loop's backend that took the held lock (its release reuses it).
    _store: AsyncBackend | None = None

    if TYPE_CHECKING:  # Lock's own

        @property
        def held(self) -> bool: ...

        @property
        def lost(self) -> bool: ...

        def _send(self, signal: Signal, owner: object, **details: object) -> None: ...

        def _send_contended(
            self, backend: LockBackend, key: str, waited: float
        ) -> None: ...

        def _store_error(
            self, backend: LockBackend, key: str, doing: str, exc: BaseException
        ) -> LockBackendError: ...

        def _stop_heartbeat(self) -> None: ...

        def _backend(self) -> tuple[LockBackend, str]: ...

        def release_quietly(self) -> None: ...

        def check(self) -> bool: ...

    async def aacquire(
        self, *, blocking: bool = False, timeout: float | None = None
    ) -> bool:
        """``acquire()``, awaited; cancelled, it releases what a take in flight
        got. Its decisions are ``taking``'s, shared with ``acquire``."""
        expire, alias, protocol, renew, bound = take_settings(self, blocking, timeout)
        store = warm_backend(alias, protocol) or await loop_backend(alias, protocol)
        key = (backend := store.sync).keys_for(self.lock_id)[0]
        beat = beat_for(backend, expire) if renew else None
        record = record_beside(alias, bound, backend, key)
        tried_at = started = time.monotonic()
        if record is not None and started >= record.due:  # written first
            record = await _kept(alias, backend, record)
            tried_at = started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        pause = POLL_MIN if blocking else None
        place, take = self._first_take(store, key, blocking)
        while True:
            token = (new_token if record is None else new_live_token)(self.owner)
            cancel = _LetGo((self, store, key, token))
            try:
                hold = await take(key, token, expire, cancel)
                if hold is None and store.looks.get(key, 0.0) <= tried_at:
                    hold = await self._from_dead(
                        store, key, token, expire, cancel, place
                    )
            except store.errors as exc:
                await aleft_line(place)
                raise take_failed(self, alias, backend, key, token, exc) from exc
            if hold is not None:
                acq = Acquisition(
                    self, backend, alias, key, token, hold, expire, tried_at, record
                )
                if hold_taken(self, acq, beat, started):
                    self._store = store  # (its release reuses it)
                    return True
                with contextlib.suppress(*store.errors):  # refused
                    await store.release(key, hold, token)
                if tried_at == started:  # the first take late: again at once
                    tried_at = time.monotonic()
                    continue
            wait = after_refusal(self, backend, key, pause, deadline, started)
            if wait is None:
                await aleft_line(place)
                return False
            if place is not None:
                await place.await_turn(deadline)
            elif place := async_place_for(store, key, blocking and not self._take_over):
                take = place.atake  # (its first try in line at once)
            else:
                await asyncio.sleep(wait[0])
            pause, tried_at = wait[1], time.monotonic()

    def _first_take(
        self, store: AsyncBackend, key: str, blocking: bool
    ) -> tuple[
        AsyncPlace | None,
        Callable[[str, str, float, Cancel | None], Awaitable[Hold | None]],
    ]:
        """The place in line of a blocking acquire on a store whose lines wake
        a loop's waiters at once (else it joins once refused, as in
        ``Lock.acquire``), and its first try's take: in line, the store's, or
        a take-over. (The record's check before it is written out in
        ``aacquire``: a coroutine per uncontended acquire cost 2 % of it.)"""
        if blocking and not self._take_over:
            place = async_place_for(store, key, True, True)
            if place is not None:
                return place, place.atake
        if self._take_over is None:
            return None, store.take
        return None, self._taking_over(store)

    def _taking_over(
        self, store: AsyncBackend
    ) -> Callable[[str, str, float, Cancel | None], Awaitable[Hold | None]]:
        """A try's take with ``take_over``: in a thread, carried through a
        cancel (``cancel``: what to do with what it got, and with a take
        whose fate is unknown)."""
        taken_over = self._take_over
        assert taken_over is not None
        alias, protocol = store.alias, store.sync.protocol

        def take(
            key: str, token: str, expire: float, cancel: Cancel | None
        ) -> Awaitable[Hold | None]:
            def take_over() -> Hold | None:
                backend = backend_for(alias, protocol=protocol)
                return backend.take_over(key, taken_over, token, expire)

            assert cancel is not None
            work = asyncio.to_thread(take_over)
            return carried_through(work, cancel.taken, cancel.failed)

        return take

    async def _from_dead(
        self,
        store: AsyncBackend,
        key: str,
        token: str,
        expire: float,
        cancel: Cancel,
        place: AsyncPlace | None,
    ) -> Hold | None:
        """After a refused take, when due (and not a ``take_over``): the lock's
        holder looked at, in a thread, and the lock taken from it if it is
        dead (carried through a cancel, as a take), which takes the waiter
        out of the line (``place``)."""
        if self._take_over is not None:
            return None
        store.looks[key] = time.monotonic() + LOOK_EVERY
        free_too = place is None or place.lines.guards_takes
        work = asyncio.to_thread(
            _take_from_dead, self.lock_id, store, key, token, expire, free_too
        )
        hold = await carried_through(work, cancel.taken, cancel.failed)
        if hold is not None:
            store.looks.pop(key, None)
            await aleft_line(place)
        return hold

    async def arelease(self) -> bool:
        """``release()``, awaited: True if this object still owned the lock
        and removed it. A cancel while it is in flight lets it finish."""
        acq = self._acq
        if acq is None or acq.hold is None or acq.fork != fork_generation[0]:
            acq = require_hold(self.lock_id, acq, "arelease()")
        if self._heartbeat is not None:
            self._stop_heartbeat()
        # A beat in flight ends before the release (the guard orders them);
        # waited for on the loop, never in it.
        while not acq.guard.acquire(False):
            await asyncio.sleep(0.001)
        try:
            hold, token = acq.hold, acq.token
            if hold is None:  # lost earlier, and reported then
                return False
            store, self._store = self._store, None
            if (
                store is None
                or store.loop() is not asyncio.get_running_loop()
                or store.generation != _generation[0]
            ):  # (released from another loop, or CACHES changed since)
                alias, protocol = acq.alias, acq.backend.protocol
                store = warm_backend(alias, protocol) or await loop_backend(
                    alias, protocol
                )
            try:
                released = await store.drop(acq.key, hold, token)
            except store.errors as exc:
                error = release_error(self, acq, acq.backend, acq.key, exc)
                raise error from exc
            if not released:
                report_lost(acq, "release")
                return False
            acq.hold = acq.lock = None  # no cycle left (see Acquisition.lock)
            if acq.record is not None:  # forgotten now, not at the next beat
                acq.record.held.pop(id(self), None)
            if WAITING_HERE:  # this process's waiters on it woken at once
                wake_here(acq.alias, acq.key)
        finally:
            acq.guard.release()
        if lock_released.receivers:
            self._send(lock_released, token, fence=acq.fence, held=acq.held_for())
        return True

    async def aextend(self, seconds: float | None = None) -> bool:
        """``extend()``, on an executor thread: True if extended."""
        acq = require_hold(self.lock_id, self._acq, "aextend()")
        if seconds is not None:
            validate_expire(seconds, name="seconds")

        def extend() -> bool:
            with self._guard:
                return extend_hold(acq, seconds, "extend")

        return await asyncio.to_thread(extend)

    async def acheck(self) -> bool:
        """``check()``: no round trip, so it never waits; here for symmetry."""
        return self.check()

    async def afence(self) -> int | None:
        """``fence``, drawn on an executor thread when not drawn yet."""
        acq = self._acq
        if acq is None:
            return None
        if acq.fence is not None:
            return acq.fence
        return await asyncio.to_thread(draw_fence, acq)

    async def arelease_quietly(self) -> None:
        """``release_quietly()``, awaited: logs a failed release."""
        acq = self._acq
        if acq is None or acq.hold is None:
            self._stop_heartbeat()
            return
        if acq.fork != fork_generation[0]:
            return
        try:
            await self.arelease()
        except LockBackendError:
            logger.exception("Could not release lock %r", self.lock_id)


async def _kept(alias: str, backend: LockBackend, record: Record) -> Record | None:
    """``record`` written (it is due, as in ``Lock.acquire``), on an executor
    thread; None if it could not be."""
    protocol = backend.protocol
    written = await asyncio.to_thread(
        lambda: record.ensure(backend_for(alias, protocol=protocol))
    )
    return record if written else None


def _take_from_dead(
    lock_id: str,
    store: AsyncBackend,
    key: str,
    token: str,
    expire: float,
    free_too: bool,
) -> Hold | None:
    backend = backend_for(store.alias, protocol=store.sync.protocol)
    backend.looks.pop(key, None)  # (the loop's ``looks`` decided it is due)
    return take_from_dead(lock_id, backend, key, token, expire, free_too)


class _LetGo(tuple[Any, ...]):
    """What a take of a token does if its caller is cancelled once it was
    sent (``backends.aio.base.Cancel``): release what it got; a take whose
    fate is unknown, watched. One per try, made before the take is sent:
    ``(lock, store, key, token)``, a tuple: made in C, where an object with an
    ``__init__`` runs Python code on every try."""

    __slots__ = ()

    async def taken(self, hold: Hold | None) -> None:
        """Release what the take got."""
        if hold is None:
            return
        _lock, store, key, token = self
        try:
            await store.release(key, hold, token)
        except store.errors:
            logger.warning(
                "A lock taken for a cancelled acquire could not be released; it "
                "expires by itself",
                exc_info=True,
            )

    def failed(self, exc: BaseException) -> None:
        """The take failed: its token, perhaps stored, is removed once the
        store answers (``orphans``)."""
        lock, store, key, token = self
        if isinstance(exc, store.errors):
            take_failed(lock, store.alias, store.sync, key, token, exc)
