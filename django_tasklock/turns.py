"""A blocking ``Semaphore.acquire`` waits its turn in line.

Where the store keeps lines (``backend.lines``: Redis, memcached,
PostgreSQL) and ``TASKLOCK["WAITING"]`` is ``"line"``, the blocking acquires
of a semaphore whose slots are all held queue behind one lock of the
semaphore's own, its turn (``<name>#slot-turn``, in the slots' hash slot on
a cluster): they wait for it in that lock's line (``locks.line``), first come
first served, each woken as the one before it is served. The waiter that
holds the turn takes the first slot that frees, reading the slots every
``TURN_POLL`` (and at once after a release in its own process), then hands
the turn on.

A blocking acquire reads the turn with the slots, in the same round trip:
while the turn is held (somebody waits) it joins the line even if a slot is
free, so a holder that takes a slot again at once after its release goes
behind the waiters instead of starving them. While the turn passes from
one waiter to the next (the release, the next one's wake-up and take), it
reads as free: a holder coming back then may take a free slot out of turn,
once per handoff; the new holder of the turn still takes the next slot that
frees. A non-blocking acquire never waits: it takes a free slot out of turn
(one hold, not again and again).

What it costs: nothing more while nobody waits (the turn's key is read with
the slots); a waiter blocks in the turn's line as a lock's waiter does; the
one that holds the turn reads the slots a hundred times a second. A turn
holder that dies keeps the turn until it expires (``TURN_EXPIRE``; it is
extended while its holder waits), or, with ``LIVENESS``, until crash recovery
finds it dead; then the next waiter takes it. The turn decides order, never
who holds a slot: each slot is still its own ``Lock``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final, Protocol

from .backends.capabilities import wait_here_any
from .keys import SLOT_MARK
from .locks import Lock

if TYPE_CHECKING:
    from .backends import LockBackend


class _Slots(Protocol):
    """What a turn needs of its ``semaphores.Semaphore``."""

    lock_id: str
    _cache: str | None

    def _read(self, backend: LockBackend, keys: list[str]) -> list[bool]: ...

    def _take_from(
        self, held: list[bool], ids: list[str], keys: list[str], backend: LockBackend
    ) -> bool: ...


__all__ = ["TURN_EXPIRE", "TURN_POLL", "in_turn", "turn_id"]

#: How often the waiter that holds the turn reads the slots.
TURN_POLL: Final = 0.01
#: Seconds the turn lasts past its last extension: how long a dead waiter
#: holds up the line at most, where no liveness record tells it dead sooner.
TURN_EXPIRE: Final = 5.0


def turn_id(name: str) -> str:
    """The lock id of the turn of the semaphore ``name``."""
    return f"{name}{SLOT_MARK}turn"


def in_turn(
    semaphore: _Slots,
    ids: list[str],
    backend: LockBackend,
    keys: list[str],
    held: list[bool],
    deadline: float | None,
) -> bool:
    """A blocking acquire of ``semaphore`` (its slots ``ids``, at ``keys``,
    read with the turn last: ``held``) that waits in line: a slot taken at
    once where nobody waits, else in turn; False once ``deadline`` passed."""
    if not held[-1] and semaphore._take_from(held[:-1], ids, keys, backend):
        return True
    turn = Lock(turn_id(semaphore.lock_id), expire=TURN_EXPIRE, cache=semaphore._cache)
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    if not turn.acquire(blocking=True, timeout=left):
        return False
    try:
        return _served(semaphore, ids, backend, keys, turn, deadline)
    finally:
        turn.release_quietly()  # the next waiter's turn


def _served(
    semaphore: _Slots,
    ids: list[str],
    backend: LockBackend,
    keys: list[str],
    turn: Lock,
    deadline: float | None,
) -> bool:
    """Holding the turn: the first slot that frees; False at ``deadline``."""
    extended = time.monotonic()
    waiter = f"turn:{id(turn)}"
    while True:
        if semaphore._take_from(semaphore._read(backend, keys), ids, keys, backend):
            return True
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return False
        if now - extended > TURN_EXPIRE / 3:
            extended = now
            turn.extend()  # (lost: the next waiter has it; this one still tries)
        wait = TURN_POLL if deadline is None else min(TURN_POLL, deadline - now)
        # Woken at once by a release of one of the slots in this process.
        wait_here_any(backend.alias, keys, waiter, wait)
