"""What a holder does with its hold besides releasing it (``Lock.release``):
extend it, hand it over.

Each acts on an ``Acquisition`` under its lock's guard (so a heartbeat's
extend is never in flight across a release), owner-checked by the store, and
reports the lock lost when the store no longer has it for this holder.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .loss import report_lost

if TYPE_CHECKING:
    from .acquisition import Acquisition

__all__ = ["extend_hold", "hand_over_hold"]


def extend_hold(acq: Acquisition, seconds: float | None, doing: str) -> bool:
    """Extend the hold ``acq``, owner-checked, to ``seconds`` (None: its
    expiry) from now, never past its max_hold; False (and reported lost) if the
    store no longer has it. The caller holds the lock's guard; raises
    ``LockBackendError``."""
    hold, lock = acq.hold, acq.lock
    if hold is None or lock is None:
        return False
    expire = acq.capped(acq.expire if seconds is None else seconds)
    backend, key = lock._backend()
    sent_at = time.monotonic()
    try:
        hold = backend.extend(key, hold, acq.token, expire)
    except backend.errors as exc:
        raise lock._store_error(backend, key, "extend the lock", exc) from exc
    if hold is None:
        report_lost(acq, doing)
        return False
    acq.hold = hold
    acq.life = backend.shortest_life(expire)
    acq.valid_until = sent_at + acq.life
    return True


def hand_over_hold(acq: Acquisition, value: str, expire: float) -> bool:
    """Store ``value`` in place of this hold's token, in one conditional
    write, and stop holding; True if the store had the hold and now has
    ``value``. Raises ``LockBackendError`` (the hold is then kept)."""
    with acq.guard:
        hold, lock = acq.hold, acq.lock
        if hold is None or lock is None:
            return False
        backend, key = lock._backend()
        try:
            replaced = backend.replace(key, hold, acq.token, value, expire)
        except backend.errors as exc:
            raise lock._store_error(backend, key, "hand the lock over", exc) from exc
        acq.hold = None
        if replaced is None:
            report_lost(acq, "hand over")
            return False
    return True
