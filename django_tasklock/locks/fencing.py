"""A lock's fencing token, drawn from the lock id's counter on first read.

The counter only grows, and a token is drawn only while the store confirms the
lock is still this holder's, so a token is larger than that of every earlier
acquisition whose token was read (see docs, Fencing tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exceptions import LockLost
from ..tokens import fence_counter
from .loss import held_time, report_lost

if TYPE_CHECKING:
    from .reads import StoreReads

__all__ = ["draw_fence"]


def draw_fence(lock: StoreReads) -> int | None:
    """``lock``'s fencing token, drawn now if it was not yet (one round trip)."""
    with lock._guard:
        if lock._fence is not None:
            return lock._fence
        if lock._hold is None:
            if lock._reported:
                raise LockLost(lock.lock_id, held_time(lock))
            return None
        backend, key = lock._backend()
        assert lock.token is not None
        counter = fence_counter(backend.keys_for(lock.lock_id)[1], lock._held_expire)
        try:
            drawn = backend.draw_fence(key, lock._hold, lock.token, counter)
        except backend.errors as exc:
            raise lock._store_error(
                backend, key, "draw the fencing token", exc
            ) from exc
        if drawn is None:
            report_lost(lock, "fence")
            raise LockLost(lock.lock_id, held_time(lock))
        lock._fence = drawn
        return drawn
