"""A lock's fencing token, drawn from the lock id's counter on first read.

The counter only grows, and a token is drawn only while the store confirms the
lock is still this holder's, so a token is larger than that of every earlier
acquisition whose token was read (see docs, Fencing tokens).
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any, Protocol

from ..exceptions import LockLost, LockUsageError
from ..tokens import fence_counter
from .loss import held_time, report_lost

if TYPE_CHECKING:
    from .acquisition import Acquisition

__all__ = [
    "FENCES_WANTED",
    "FenceHolder",
    "Pushed",
    "draw_fence",
    "fence_to_write",
    "held",
    "holders",
    "in_reach",
    "push_holder",
    "want_fences",
]


class FenceHolder(Protocol):
    """What a fenced write reads of the holder whose fence it carries: a
    ``Lock``, a ``Semaphore``'s slot or a ``Leadership``."""

    lock_id: str

    def held_fence(self) -> int:
        """The fence of the hold now, for a write: raises ``LockLost`` once
        the hold is known lost, ``LockUsageError`` if nothing is held."""
        ...


class HeldRun(Protocol):
    """What a fenced write reads of a ``runs.Run`` in progress."""

    name: str

    @property
    def lock(self) -> FenceHolder: ...


# The runs of decorated calls in progress in this context (thread, greenlet
# or asyncio task), innermost last: ``runs.Run`` objects, pushed by the
# modes (``runs.held`` is this variable; it lives here, below the runs, so
# that fenced writes find a run's lock without a push of their own).
held: ContextVar[tuple[Any, ...]] = ContextVar("tasklock_held", default=())

#: One holder a fenced write in this context finds (a ``with`` block's Lock or
#: Semaphore, a Leadership, ``fenced_by``'s holder): it, the names besides
#: its lock id a ``FenceField(lock=...)`` may claim it by, the runs in
#: progress when it was pushed (it is inside those, and outside any run
#: pushed after it), and the one pushed before it.
Pushed = tuple[FenceHolder, tuple[str, ...], tuple[Any, ...], "Pushed | None"]

#: The innermost holder pushed in this context, its chain the others. A
#: context variable goes with the context: into the tasks an ``async with``
#: block starts and the threads ``sync_to_async`` hands work to. (One
#: ``set`` a block, and no tuple copied: a ``with memcache_lock`` block is a
#: hot path, and a set copies the context's map, thousands of instructions.)
holders: ContextVar[Pushed | None] = ContextVar("tasklock_fence_holders", default=None)


#: Whether a model with a ``FenceField`` was defined in this process (``[0]``):
#: until one is, no fenced write can be made, and the ``with`` blocks of
#: Lock, Semaphore and ``memcache_lock`` push no holder (the push, a set of a
#: context variable and its reset, made a ``memcache_lock`` cycle 76,712
#: instructions against 71,363 without: ``make bench-cpu``). Models are
#: defined at ``django.setup()``; a block entered before a model defined
#: later is out of a fenced write's reach (refused, ``NoFence``: never
#: unfenced).
FENCES_WANTED: list[bool] = [False]


def want_fences() -> None:
    """A model with a fence field exists: blocks push their holders."""
    FENCES_WANTED[0] = True


def push_holder(holder: FenceHolder, *names: str) -> Token[Any]:
    """Make ``holder`` the innermost one fenced writes here find; pass the
    token to ``holders.reset`` when its block ends."""
    return holders.set((holder, names, held.get(), holders.get()))


def in_reach() -> list[tuple[FenceHolder, tuple[str, ...]]]:
    """Every holder in reach here, innermost first, with its other names: the
    runs in progress and the other holders, in the order they were entered."""
    runs = held.get()
    others: list[Pushed] = []
    pushed = holders.get()
    while pushed is not None:
        others.append(pushed)
        pushed = pushed[3]
    others.reverse()  # outermost first: popped innermost first below
    found: list[tuple[FenceHolder, tuple[str, ...]]] = []
    for depth in range(len(runs), -1, -1):
        while others and len(others[-1][2]) >= depth:
            holder, names, _runs, _outer = others.pop()
            found.append((holder, names))
        if depth:
            run = runs[depth - 1]
            found.append((run.lock, (run.name,)))
    return found


def draw_fence(acq: Acquisition) -> int | None:
    """The fencing token of the hold ``acq``, drawn now if it was not yet (one
    round trip)."""
    with acq.guard:
        if acq.fence is not None:
            return acq.fence
        hold, lock = acq.hold, acq.lock
        if hold is None or lock is None:
            if acq.reported:
                raise LockLost(acq.lock_id, acq.held_for())
            return None
        backend, key = lock._backend()
        counter = fence_counter(backend.keys_for(lock.lock_id)[1], acq.expire)
        try:
            drawn = backend.draw_fence(key, hold, acq.token, counter)
        except backend.errors as exc:
            raise lock._store_error(
                backend, key, "draw the fencing token", exc
            ) from exc
        if drawn is None:
            report_lost(acq, "fence")
            raise LockLost(lock.lock_id, acq.held_for())
        acq.fence = drawn
        return drawn


class _Fenced(Protocol):
    """What ``fence_to_write`` reads of a ``Lock``."""

    lock_id: str

    @property
    def acquisition(self) -> Acquisition | None: ...

    @property
    def lost(self) -> bool: ...

    @property
    def fence(self) -> int | None: ...


def fence_to_write(lock: _Fenced) -> int:
    """``Lock.held_fence()``: the fence of the lock held now; ``LockLost`` once
    it is known lost, ``LockUsageError`` when nothing is held."""
    acq = lock.acquisition
    if acq is None or (acq.hold is None and not acq.lost):
        raise LockUsageError(
            f"Lock {lock.lock_id!r} is not held here (never taken, or released), "
            "so it has no fence to write with; write while the lock is held."
        )
    if lock.lost:
        raise LockLost(lock.lock_id, held_time(acq))
    fence = lock.fence
    if fence is None:  # lost as the fence was drawn
        raise LockLost(lock.lock_id, held_time(acq))
    return fence
