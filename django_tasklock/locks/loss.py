"""Telling that a lock was lost: one WARNING and one ``lock_lost`` per hold.

A lock is lost when the store no longer has its holder's token (it expired, was
evicted, flushed, released by force or lost in a restart), or when the least time
the store is sure to keep it has passed with no extension since. Whoever finds it
first (the heartbeat, ``release()``, ``extend()``, a read of ``lost``) reports it;
the others find it reported.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from .. import orphans
from ..signals import lock_lost

if TYPE_CHECKING:
    from ..backends import LockBackend
    from ..exceptions import LockBackendError
    from .acquisition import Acquisition, Holder

__all__ = [
    "FORCED",
    "held_time",
    "release_failed",
    "report_lost",
    "take_failed",
    "unextended",
]

logger = logging.getLogger(__name__)

#: Why a lock the store no longer has for its holder was lost.
FORCED = "it expired, was evicted, flushed, released by force or lost in a restart"

# Orders the flags of a loss report (rare) between a holder's threads; one for
# every lock, rather than one more allocation per Lock.
_REPORT_GUARD = threading.Lock()


def _new_report_guard() -> None:
    global _REPORT_GUARD
    _REPORT_GUARD = threading.Lock()  # it may have been held at the fork


os.register_at_fork(after_in_child=_new_report_guard)


def unextended(acq: Acquisition, cause: str = "no extension reached the store") -> str:
    """Why a lock whose sure life ran out is lost, and what to do."""
    if acq.life < 1:
        return (
            f"{cause} in time: the store may drop a lock stored for "
            f"{acq.expire}s at any moment (memcached counts whole "
            "seconds on a clock that may tick late, so it is sure to keep a lock "
            "only for its expiry less 2 seconds). Use an expire of 3 seconds or "
            "more, with renew=True for long work"
        )
    return (
        f"{cause} within the {acq.life:.0f}s the store is sure to keep the "
        "lock. Use a longer expire, or renew=True for long work"
    )


def lapsed(acq: Acquisition) -> bool:
    """Whether a held lock's sure life, or its holder's liveness record, may
    have run out (judged by the clock here: no round trip)."""
    if acq.hold is None:
        return False
    now = time.monotonic()
    record = acq.record
    if record is None:
        return now >= acq.valid_until
    sure_until, lapsed_at = record.kept_for(acq.key)
    return now >= acq.valid_until or now >= sure_until or lapsed_at >= acq.acquired_at


def taken_too_late(acq: Acquisition) -> bool:
    """Whether a lock just taken had outlived its sure life before its taker
    could use it: the reply came, or this process resumed, only after the
    store may have let it go (and another holder taken it). Such a take is
    not held: forgotten here, logged; the caller releases it if it is still
    its own, and counts it a refusal."""
    if not lapsed(acq) or acq.life <= 0:
        return False
    if acq.record is not None:
        acq.record.held.pop(id(acq.lock), None)
    logger.warning(
        "Lock %r was taken only %.1fs after its command was sent, past the "
        "%.1fs the store surely keeps it: this process or the store stood "
        "still meanwhile, and another holder may have it. Not held: released "
        "if still ours, and refused.",
        acq.lock_id,
        acq.acquired_at - (acq.valid_until - acq.life),
        acq.life,
    )
    return True


def lapsed_why(acq: Acquisition) -> str:
    """Why a lock whose sure life, or whose holder's liveness record, ran out
    is lost."""
    record = acq.record
    if record is None:
        return unextended(acq)
    sure_until, lapsed_at = record.kept_for(acq.key)
    if time.monotonic() < sure_until and lapsed_at < acq.acquired_at:
        return unextended(acq)
    return (
        f"this process's liveness record may have lapsed (not renewed for "
        f"{record.bound:.0f}s, TASKLOCK['LIVENESS']: the process was paused or "
        "starved, or the store unreachable), so a contender on another host "
        "may have taken the lock"
    )


def report_lost(
    acq: Acquisition, doing: str, reason: str = FORCED, *, clear: bool = True
) -> None:
    """Mark the hold ``acq`` lost and tell (WARNING, ``lock_lost``) once.

    ``clear``: forget the hold (the store no longer has it). A loss judged by
    the clock keeps it, so a release still removes the lock if it survived.
    """
    with _REPORT_GUARD:
        if clear:
            acq.hold = None
        if acq.reported:
            return
        # Lost from this instant for every thread that looks (``check()``,
        # a leadership's ``is_leader``), not only once the WARNING below is
        # written: a busy machine has taken seconds over it.
        acq.reported = acq.lost = True
    held_for = acq.held_for()
    logger.warning(
        "Lock %r was no longer held by this owner at %s, %.1fs after it was taken "
        "with an expiry of %ss: %s, and another owner may have taken it. "
        "The protected work may have overlapped; fenced writes (fence %s) are "
        "refused once a newer holder has written.",
        acq.lock_id,
        doing,
        held_for,
        acq.expire,
        reason,
        acq.fence,
    )
    lock = acq.lock
    if lock is not None and lock_lost.receivers:
        lock._send(
            lock_lost,
            acq.token,
            fence=acq.fence,
            held=held_for,
            during=doing,
            reason=reason,
        )


def take_failed(
    lock: Holder,
    alias: str,
    backend: LockBackend,
    key: str,
    token: str,
    exc: BaseException,
) -> LockBackendError:
    """The error for an acquire whose command failed with ``exc``. Sent,
    perhaps carried out, reply unknown: the token may be stored with no holder,
    so it is removed in the background once the store answers."""
    if not backend.lost_with_store(exc):
        orphans.watch(lock.lock_id, alias, backend.protocol, key, token)
    return lock._store_error(backend, key, "take the lock", exc)


def release_failed(
    acq: Acquisition, backend: LockBackend, key: str, exc: BaseException
) -> str:
    """What became of the hold ``acq`` after its release failed with ``exc``."""
    if backend.lost_with_store(exc):
        return (
            "release the lock: the server is not running, and the lock went "
            "with it (a stopped memcached keeps nothing)"
        )
    # The release may still be carried out, or not: removed once it answers.
    orphans.watch(acq.lock_id, acq.alias, backend.protocol, key, acq.token)
    left = max(0.0, acq.valid_until - time.monotonic()) + 1
    return (
        "release the lock: it is removed in the background as soon as the "
        f"store answers again, and expires by itself within {left:.0f}s at the "
        "latest"
    )


def held_time(acq: Acquisition | None) -> float:
    """Seconds since the hold ``acq`` was taken (0 if there was none)."""
    return 0.0 if acq is None else acq.held_for()
