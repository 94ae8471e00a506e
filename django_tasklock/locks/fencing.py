"""A lock's fencing token, drawn from the lock id's counter on first read.

The counter only grows, and a token is drawn only while the store confirms the
lock is still this holder's, so a token is larger than that of every earlier
acquisition whose token was read (see docs, Fencing tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..exceptions import LockLost
from ..tokens import fence_counter
from .loss import report_lost

if TYPE_CHECKING:
    from .acquisition import Acquisition

__all__ = ["draw_fence"]


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
