"""A dead holder's lock is free: judged by its token, taken in one conditional
write.

A lock's token names its holder's host and process (``tokens``). A contender
refused a lock looks at who holds it, at most every ``LOOK_EVERY`` seconds per
lock id and thread, and only then (an uncontended acquire pays nothing):

- a holder on this host is looked up in /proc: gone, exited (a zombie its
  parent has not reaped yet) or its pid now another process's (the start time
  differs) is dead;
- a holder on another host (or in another pid namespace, or hidden by
  ``hidepid``) that keeps a liveness record (``liveness``) is dead once that
  record is gone from the lock's own server; a read of it that fails tells
  nothing;
- anything else (a call's queued mark, a value other code stored, a holder
  that keeps no record) is left to expire.

A dead holder's lock is replaced by the contender's token only if the store
still holds the very item that was judged (a CAS id on memcached, the value on
Redis), so two contenders never both take it, and a live holder that renewed
meanwhile keeps it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Final, cast

from ..tokens import (
    KEEPS_RECORD,
    KEPT_ELSEWHERE,
    holder_record_id,
    local_verdict,
    token_host,
    token_process,
)

if TYPE_CHECKING:
    from ..backends import Hold, LockBackend

__all__ = ["LOOK_EVERY", "judge", "take_from_dead"]

logger = logging.getLogger(__name__)

#: The least time between two looks at the holder of one lock id, per thread.
LOOK_EVERY: Final = 0.5


def judge(value: object, backend: LockBackend, key: str) -> tuple[bool | None, str]:
    """Whether the holder whose token is ``value``, stored at ``key``, still
    runs, and why: True, False, or None when nobody can tell (then the lock
    lasts until it expires). Reads the holder's liveness record beside the
    lock when the holder is on another host; a read that fails (or times out)
    tells nothing, and is None, never False."""
    parsed = token_process(value)
    if parsed is None:
        return None, "its value is not a lock token (a call's mark, or other code's)"
    owner, process = parsed
    host = token_host(owner)
    alive, why = local_verdict(host, process)
    if alive is not None:
        return alive, why
    if process.endswith(KEPT_ELSEWHERE):
        return (
            None,
            f"{why}, which keeps its liveness record where this build does not look",
        )
    if not process.endswith(KEEPS_RECORD):
        return None, f"{why}, which keeps no liveness record"
    pid = process.partition("-")[0]
    kept = backend.records
    if kept is None:
        return None, f"{why}, whose liveness record this store cannot keep"
    try:
        seen = kept.read_record(key, holder_record_id(owner, process))
    except backend.errors as exc:
        return None, (
            f"{why}, whose liveness record could not be read "
            f"({type(exc).__name__}: {exc})"
        )
    if seen is None:
        return False, (
            f"process {pid} on {host} has shown no sign of life within its "
            "TASKLOCK['LIVENESS'] (its liveness record is gone)"
        )
    try:
        ago = f"{max(time.time() - float(cast(str, seen)), 0.0):.1f}s ago"
    except (TypeError, ValueError):
        ago = "recently"
    return True, f"process {pid} on {host} renewed its liveness record {ago}"


def take_from_dead(
    lock_id: str,
    backend: LockBackend,
    key: str,
    token: str,
    expire: float,
    free_too: bool = True,
) -> Hold | None:
    """After an acquire was refused: the lock, taken for ``token``, if its
    holder is dead (or it was freed in between, unless not ``free_too``: a
    waiter in a line its store's takes do not guard leaves a free lock to
    the line); None if it lives, cannot be judged, or was looked at less
    than ``LOOK_EVERY`` ago (the caller may test ``backend.looks`` first, as
    ``Lock.acquire`` does). Raises ``backend.errors``."""
    now = time.monotonic()
    looks = backend.looks
    if looks.get(key, 0.0) > now:
        return None
    if len(looks) >= 4096:
        looks.clear()
    looks[key] = now + LOOK_EVERY
    peek = backend.peek(key)
    if peek is None:  # freed in between
        return backend.acquire(key, token, expire) if free_too else None
    alive, why = judge(peek.value, backend, key)
    if alive is not False:
        logger.debug("Left lock %r to its holder: %s", lock_id, why)
        return None
    hold = backend.replace(key, peek.hold, peek.value, token, expire)
    if hold is not None:
        del looks[key]
        logger.warning(
            "Took lock %r from a dead holder: %s. Its token was %r.",
            lock_id,
            why,
            peek.value,
        )
    return hold
