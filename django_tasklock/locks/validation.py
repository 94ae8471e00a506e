"""What a Lock's options may be: checked when the Lock is made or acquired."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final, Literal

from ..backends import fork_generation
from ..exceptions import InvalidArgument, InvalidArgumentType, LockUsageError
from ..tokens import token_owner

if TYPE_CHECKING:
    from ..backends import LockBackend
    from .acquisition import Acquisition

__all__ = [
    "MAX_OID",
    "MIN_BEAT",
    "ON_LOST_POLICIES",
    "OnLost",
    "beat_for",
    "check_cache",
    "check_oid",
    "owner_for",
]

OnLost = Literal["warn", "raise"]
ON_LOST_POLICIES: Final = ("warn", "raise")
#: The shortest heartbeat interval: renewing more often than this is refused.
MIN_BEAT: Final = 0.1
#: The longest oid kept in a token: it is for people reading the store.
MAX_OID: Final = 200


def check_oid(oid: object) -> str:
    """Return ``oid`` if it can be written into a stored token, else raise."""
    if not isinstance(oid, str):
        raise InvalidArgumentType(f"oid must be a str, not {type(oid).__name__}.")
    problem = None
    if "#" in oid:
        problem = "'#' separates the task id in a token"
    elif len(oid) > MAX_OID:
        problem = f"it is longer than {MAX_OID} characters"
    else:
        try:
            oid.encode("utf-8")
        except UnicodeEncodeError:
            problem = "it is not valid text (a lone surrogate): no store can keep it"
    if problem is not None:
        raise InvalidArgument(
            f"oid {oid[:40]!r} cannot be stored in a lock's token: {problem}. Pass "
            "a short name of the holder (Celery's app.oid), or leave oid out."
        )
    return oid


def check_cache(cache: object) -> str:
    """Return ``cache`` if it can name a CACHES entry, else raise."""
    if not isinstance(cache, str) or not cache:
        raise InvalidArgumentType(
            f"cache must be the name of a CACHES entry, not {cache!r}."
        )
    return cache


def owner_for(oid: object, host: str) -> str:
    """Who a holder is, as written at the start of its tokens: ``oid@host``, or
    ``host`` alone for an empty oid."""
    if not oid:
        if not isinstance(oid, str):
            raise InvalidArgumentType(f"oid must be a str, not {type(oid).__name__}.")
        return host
    return f"{check_oid(oid)}@{host}"


def beat_for(backend: LockBackend, expire: float) -> float:
    """The heartbeat interval of a renewing lock stored for ``expire`` seconds:
    a third of the shortest time the store is sure to keep it."""
    beat = backend.shortest_life(expire) / 3
    if beat < MIN_BEAT:
        raise LockUsageError(
            f"renew=True needs a longer expiry than {expire}s on {backend.kind}: "
            f"a lock stored for {expire}s may go after "
            f"{backend.shortest_life(expire)}s there (memcached counts whole "
            "seconds on a clock that may tick late), too soon to renew in time. "
            "Use an expire (and max_hold) of 3 seconds or more."
        )
    return beat


def misuse(lock_id: str, held: bool) -> LockUsageError:
    """The error for an acquire() the Lock cannot do as asked."""
    if held:
        return LockUsageError(
            f"Lock {lock_id!r} is already held by this object; release() it "
            "first, or make a new Lock for a second holder."
        )
    return LockUsageError("timeout= needs blocking=True.")


def require_hold(lock_id: str, acq: Acquisition | None, doing: str) -> Acquisition:
    """The hold ``doing`` (release, extend, hand over) acts on; refused on a
    Lock that does not hold its lock, or in a process forked while it held it."""
    if acq is None or (acq.hold is None and not acq.reported):
        raise LockUsageError(
            f"{doing} called on Lock {lock_id!r}, which this object does not "
            "hold; call acquire() first."
        )
    if acq.fork != fork_generation[0]:
        owner = token_owner(acq.token)
        holder = "(unknown)" if owner is None else str(owner[1])
        raise LockUsageError(
            f"{doing} called on Lock {lock_id!r} in process {os.getpid()}, "
            f"a fork of process {holder} that holds it. A forked "
            "child is not the lock's owner and may not release or extend it; do "
            "that in the parent (the child may read owned(), ttl() and fence)."
        )
    return acq
