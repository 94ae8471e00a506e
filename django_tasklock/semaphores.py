"""``Semaphore``: at most ``limit`` holders of one name at a time.

A semaphore of ``limit`` N is N slots, ``<name>#slot-0`` to ``<name>#slot-N-1``,
and each slot is an ordinary owned ``Lock``: a holder holds exactly one slot, so
everything a Lock promises holds per slot. A release or renewal acts only on the
holder's own slot; a crashed holder's slot alone frees when it expires (renewal
keeps a live one); a holder whose slot was lost is told as a lock's holder is;
each acquisition has its slot's fencing token (drawn when first read).

Acquiring reads every slot in one round trip and takes a free one in a second
(a full semaphore costs the one read); releasing is the slot lock's one round
trip. A blocking acquire waits its turn in line where the store keeps lines
(``turns``), first come first served. Lowering ``limit`` between deploys leaves
the slots above the new limit to their holders until they finish, and nobody
takes those slots again, so once they have finished no more than the new limit
run.

The async twins (``aacquire``, ``async with``...) read the slots with the event
loop's own connections (``aio``) and take one with ``Lock.aacquire``.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any, Final

from .aio import loop_backend
from .backends import backend_for
from .conf import settings
from .exceptions import (
    InvalidArgument,
    InvalidArgumentType,
    LockBackendError,
    LockUsageError,
)
from .keys import SLOT_MARK, check_lock_id
from .locks import POLL_MIN, Holding, Lock, OnLost, backoff
from .locks.waiting import next_wait
from .turns import in_turn, turn_id

if TYPE_CHECKING:
    from .backends import LockBackend

__all__ = ["SLOT_MARK", "Semaphore", "slot_id", "validate_limit"]

#: The most slots a semaphore may have: each is read on every acquire.
MAX_LIMIT: Final = 1000


def slot_id(name: str, slot: int) -> str:
    """The lock id of slot ``slot`` of the semaphore ``name``."""
    return f"{name}{SLOT_MARK}{slot}"


def validate_limit(limit: object, name: str = "limit") -> int:
    """``limit`` if it is an int from 1 to MAX_LIMIT, else a ValueError/TypeError."""
    what = "how many may hold at once" if name == "limit" else "how many may wait"
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise InvalidArgumentType(f"{name} must be an int ({what}), not {limit!r}.")
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument(f"{name} must be from 1 to {MAX_LIMIT}, not {limit}.")
    return limit


class Semaphore(Holding):
    """At most ``limit`` owners of ``name`` at once; each holds one slot, a Lock.

    ::

        fetches = Semaphore(f"fetch:{host}", limit=2, expire=30, renew=True)
        with fetches:                     # LockNotAcquired when all slots are held
            download(url, fence=fetches.fence)

        if fetches.acquire(blocking=True, timeout=60):
            try:
                ...
            finally:
                fetches.release()

    The options are ``Lock``'s (``expire``, ``cache``, ``oid``, ``renew``,
    ``max_hold``, ``on_lost``), applied to the slot taken. One object is one
    holder: do not share it between threads.
    """

    def __init__(
        self,
        name: str,
        limit: int,
        *,
        expire: float | None = None,
        cache: str | None = None,
        oid: str | None = None,
        renew: bool | None = None,
        max_hold: float | None = None,
        on_lost: OnLost = "warn",
    ) -> None:
        self.lock_id = check_lock_id(name)
        self.limit = validate_limit(limit)
        self._options: dict[str, Any] = {
            "expire": expire,
            "cache": cache,
            "oid": oid,
            "renew": renew,
            "max_hold": max_hold,
            "on_lost": on_lost,
        }
        # Checks every option now, as Lock() does, rather than at acquire.
        Lock(slot_id(self.lock_id, 0), **self._options)
        self._cache = cache
        self.max_hold = max_hold
        #: The slot's Lock while held (also after it was found lost).
        self.lock: Lock | None = None
        #: The slot held, 0 to limit - 1.
        self.slot: int | None = None
        #: What the lock console shows of its holder (see ``Lock.about``).
        self.about: object = None

    def __repr__(self) -> str:
        state = f"slot {self.slot}" if self.held else "free"
        return f"<Semaphore {self.lock_id!r} limit {self.limit}, {state}>"

    @property
    def held(self) -> bool:
        lock = self.lock
        return lock is not None and lock.held

    @property
    def fence(self) -> int | None:
        """The fencing token of this acquisition (its slot's counter)."""
        return None if self.lock is None else self.lock.fence

    def held_fence(self) -> int:
        """The held slot's ``Lock.held_fence()``."""
        if self.lock is None:
            raise LockUsageError(
                f"Semaphore {self.lock_id!r} holds no slot here, so it has no "
                "fence to write with; write while a slot is held."
            )
        return self.lock.held_fence()

    @property
    def token(self) -> str | None:
        return None if self.lock is None else self.lock.token

    @property
    def lost(self) -> bool:
        return self.lock is not None and self.lock.lost

    @property
    def renewing(self) -> bool:
        return self.lock is not None and self.lock.renewing

    def slot_ids(self) -> list[str]:
        """The lock ids of this semaphore's slots, at its current limit."""
        return [slot_id(self.lock_id, slot) for slot in range(self.limit)]

    def acquire(self, *, blocking: bool = False, timeout: float | None = None) -> bool:
        """Take a free slot; True if taken, False if all ``limit`` are held.

        With ``blocking=True`` it tries again, with growing pauses, until it
        gets one or ``timeout`` seconds have passed. Raises ``LockBackendError``
        when the store cannot be reached.
        """
        deadline = self._deadline(blocking, timeout)
        if blocking and settings.WAITING == "line":
            ids, backend, keys = self._slots()
            if backend.lines is not None:  # in line (``turns``)
                turn = backend.keys_for(turn_id(self.lock_id))[0]
                held = self._read(backend, [*keys, turn])
                return in_turn(self, ids, backend, keys, held, deadline)
        pause = POLL_MIN
        while True:
            if self._take_a_free_slot():
                return True
            next_pause = (
                backoff(pause, deadline, time.monotonic()) if blocking else None
            )
            if next_pause is None:
                return False
            pause = next_pause

    async def aacquire(
        self, *, blocking: bool = False, timeout: float | None = None
    ) -> bool:
        """``acquire()``, awaited: the slots read and a free one taken by the
        loop's own connections (``Lock.aacquire``), waits slept on the loop."""
        deadline = self._deadline(blocking, timeout)
        pause = POLL_MIN
        while True:
            if await self._atake_a_free_slot():
                return True
            wait = next_wait(pause, deadline, time.monotonic()) if blocking else None
            if wait is None:
                return False
            await asyncio.sleep(wait[0])
            pause = wait[1]

    def _deadline(self, blocking: bool, timeout: float | None) -> float | None:
        """When a blocking acquire gives up (None: never); raises on misuse."""
        if self.held:
            raise LockUsageError(
                f"Semaphore {self.lock_id!r} already holds slot {self.slot} in this "
                "object; release() it first, or make a new Semaphore for a second "
                "holder."
            )
        if timeout is not None and not blocking:
            raise LockUsageError("timeout= needs blocking=True.")
        return None if timeout is None else time.monotonic() + timeout

    def _take_a_free_slot(self) -> bool:
        ids, backend, keys = self._slots()
        return self._take_from(self._read(backend, keys), ids, keys, backend)

    def _read(self, backend: LockBackend, keys: list[str]) -> list[bool]:
        """Whether each of ``keys`` is held (one round trip)."""
        try:
            return backend.held_many(keys)
        except backend.errors as exc:
            raise self._unread(backend, keys, exc) from exc

    def _take_from(
        self, held: list[bool], ids: list[str], keys: list[str], backend: LockBackend
    ) -> bool:
        """A slot taken, of those ``held`` says may be free; False if none."""
        for slot in self._to_try(held, keys, backend.looks):
            lock = self._slot_lock(ids[slot])
            if lock.acquire():
                self.lock, self.slot = lock, slot
                return True
        return False

    async def _atake_a_free_slot(self) -> bool:
        alias = self._cache or settings.CACHE
        store = await loop_backend(alias, settings.MEMCACHED_PROTOCOL)
        ids, backend, keys = self._slots(store.sync)
        try:
            held = await store.held_many(keys)
        except store.errors as exc:
            raise self._unread(backend, keys, exc) from exc
        for slot in self._to_try(held, keys, store.looks):
            lock = self._slot_lock(ids[slot])
            if await lock.aacquire():
                self.lock, self.slot = lock, slot
                return True
        return False

    def _slots(
        self, backend: LockBackend | None = None
    ) -> tuple[list[str], LockBackend, list[str]]:
        """The slots' lock ids, their store (``backend``, else this thread's),
        and their keys there."""
        ids = self.slot_ids()
        if backend is None:
            backend = backend_for(self._cache or settings.CACHE)
        return ids, backend, [backend.keys_for(lock_id)[0] for lock_id in ids]

    def _unread(
        self, backend: LockBackend, keys: list[str], exc: BaseException
    ) -> LockBackendError:
        return LockBackendError(
            f"Could not read the semaphore's slots: {type(exc).__name__}: {exc}",
            lock_id=self.lock_id,
            store=backend.describe(keys[0]),
        )

    @staticmethod
    def _to_try(
        held: list[bool], keys: list[str], looks: dict[str, float]
    ) -> list[int]:
        """The slots worth a try, in a random order: the free ones, or when
        every slot is held, those whose holder may be looked at now."""
        free = [slot for slot, taken in enumerate(held) if not taken]
        if not free:
            # Every slot held: a dead holder's is free too. The Lock of each
            # slot looks at its holder (locks.recovery), at most every
            # LOOK_EVERY seconds per slot: a full semaphore costs two round
            # trips per slot more then (a live slot looked at first must not
            # hide a dead one, or a call skipped there would be lost).
            now = time.monotonic()
            free = [slot for slot, key in enumerate(keys) if looks.get(key, 0.0) <= now]
        random.shuffle(free)  # holders spread over the slots, so rarely race
        return free

    def _slot_lock(self, lock_id: str) -> Lock:
        lock = Lock(lock_id, **self._options)
        lock.about, lock.slot_of = self.about, self.lock_id
        return lock

    def _held_lock(self, doing: str) -> Lock:
        if self.lock is None:
            raise LockUsageError(
                f"{doing} called on Semaphore {self.lock_id!r}, which this object "
                "does not hold; call acquire() first."
            )
        return self.lock

    def release(self) -> bool:
        """Free this holder's slot if it still owns it; True if it did."""
        return self._held_lock("release()").release()

    def release_quietly(self) -> None:
        """Release, logging instead of raising if the store fails."""
        if self.lock is not None:
            self.lock.release_quietly()

    async def arelease(self) -> bool:
        """``release()``, awaited."""
        return await self._held_lock("arelease()").arelease()

    async def arelease_quietly(self) -> None:
        """``release_quietly()``, awaited."""
        if self.lock is not None:
            await self.lock.arelease_quietly()

    async def aextend(self, seconds: float | None = None) -> bool:
        """``extend()``, awaited (on an executor thread, as ``Lock.aextend``)."""
        return await self._held_lock("aextend()").aextend(seconds)

    def extend(self, seconds: float | None = None) -> bool:
        """Reset this holder's slot's expiry; False (and a WARNING) if it was lost."""
        return self._held_lock("extend()").extend(seconds)

    async def acheck(self) -> bool:
        """``check()``: no round trip; here for symmetry with ``Lock.acheck``."""
        return self.check()

    def check(self) -> bool:
        """True while this holder's slot is not known to be lost (no round trip)."""
        return self._held_lock("check()").check()

    def owned(self) -> bool:
        """True if this object holds a slot and the store agrees."""
        return self.lock is not None and self.lock.owned()
