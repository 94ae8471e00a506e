"""The publish side of every mode: a published call's claim on its lock, in
one loop that both publishers run (Celery's ``send_task``, django.tasks'
``enqueue``).

The mode names the lock id the call is held under (``Mode.on_publish``) and
says which holder a new call may replace (``Mode.may_replace``); the duplicate
policy chooses join, raise or replace; the integration (a ``Claimant``)
supplies what only it can do: send the call, join or refuse a duplicate,
revoke the call it replaces, and the holders only it knows (its own call
sent again, an enqueue in progress).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from .. import orphans
from ..calls import call_of, store_error
from ..conf import settings
from ..exceptions import LockBackendError
from ..policies import DUPLICATES
from ..policies.duplicates import Publisher

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..backends import LockBackend, Peek
    from .base import Mode

__all__ = ["AGAIN", "TRIES", "WAIT", "Claimant", "claim", "unknown_fate"]

#: An outcome: the lock changed hands under the look; look again.
AGAIN: Final = object()
#: An outcome: a holder about to name its call; look again shortly (not
#: counted as a try).
WAIT: Final = object()
#: How often a publish looks again when the lock changes hands under it.
TRIES: Final = 5
# How often a publish looks while it WAITs.
_WAIT_PAUSE: Final = 0.005

#: What a look decides: an action (called once the loop ends), AGAIN or WAIT.
Outcome = Any


class Claimant(Publisher, Protocol):
    """One published call, as the claim loop sees it."""

    #: The store of the call's lock (and its CACHES alias), and the key its
    #: lock id is held under.
    backend: LockBackend
    alias: str
    key: str
    #: The lock id the call is held under (``Mode.on_publish``).
    queue_id: str
    #: The call's queued mark, and how long the store keeps it.
    value: str
    life: float
    #: ``on_duplicate``.
    on_duplicate: str

    def claimed(self, restore: Peek | None = None) -> Any:
        """Send the call, which holds its lock now; on failure give it back
        (to ``restore``, the value it replaced, if any)."""

    def mine(self, holder: tuple[str, str] | None, peek: Peek, waited: float) -> Any:
        """An outcome for a holder only this integration knows (its own call
        sent again; an enqueue in progress, after ``waited`` seconds of
        WAIT), or None."""

    def unmerged(self, holder: tuple[str, str] | None) -> Any:
        """An outcome for a call that is never merged into another (a Celery
        call with a task id or canvas links of its own), or None."""

    def unattached(self, peek: Peek) -> Any:
        """The outcome when the lock is held outside any call (a direct call's
        run, or other code's value)."""


def claim(mode: Mode, claimant: Claimant) -> Any:
    """Claim the call's lock for ``claimant`` and carry out what the look
    decided: send it holding the lock, send it unclaimed, or what the
    duplicate policy chose. Raises ``LockBackendError`` when the store fails,
    or when the lock changed hands ``TRIES`` times (nothing is sent)."""
    backend = claimant.backend
    tries, waiting_since = 0, None
    while tries < TRIES:
        waited = 0.0 if waiting_since is None else time.monotonic() - waiting_since
        try:
            outcome = _look(mode, claimant, waited)
        except backend.errors as exc:
            raise unknown_fate(claimant, exc) from exc
        if outcome is WAIT:
            waiting_since = waiting_since or time.monotonic()
            time.sleep(_WAIT_PAUSE)
        elif outcome is AGAIN:
            tries += 1
        else:
            action: Callable[[], Any] = outcome
            return action()
    raise LockBackendError(
        f"The lock changed hands {TRIES} times while this call was being sent; "
        "nothing was sent. Send it again",
        lock_id=claimant.queue_id,
        store=backend.describe(claimant.key),
    )


def unknown_fate(claimant: Claimant, exc: BaseException) -> LockBackendError:
    """The error for a store call that failed while writing ``claimant``'s
    mark. The write may still be carried out (a store paused past the
    client's timeout, a reply lost): the mark would then name a call no
    broker ever saw, and identical calls would join it. Nothing was sent, so
    it is removed, owner-checked, as soon as the store answers."""
    backend = claimant.backend
    if not backend.lost_with_store(exc):
        orphans.watch(
            claimant.queue_id,
            claimant.alias,
            settings.MEMCACHED_PROTOCOL,
            claimant.key,
            claimant.value,
        )
    return store_error(backend, claimant.queue_id, "take the call's lock", exc)


def _look(mode: Mode, claimant: Claimant, waited: float) -> Outcome:
    """One look at the call's lock: what to do, or AGAIN or WAIT. Raises
    ``backend.errors``."""
    backend, key, value, life = (
        claimant.backend,
        claimant.key,
        claimant.value,
        claimant.life,
    )
    if backend.acquire(key, value, life) is not None:
        return claimant.claimed
    peek = backend.peek(key)
    if peek is None:
        return AGAIN  # released in between
    holder = call_of(peek.value)
    outcome = claimant.mine(holder, peek, waited)
    if outcome is not None:
        return outcome
    if mode.may_replace(holder, peek.value, backend, key):
        if backend.replace(key, peek.hold, peek.value, value, life) is None:
            return AGAIN
        return claimant.claimed
    outcome = claimant.unmerged(holder)
    if outcome is not None:
        return outcome
    if holder is None:
        return claimant.unattached(peek)
    policy = DUPLICATES[claimant.on_duplicate]
    return policy.resolve(claimant, holder[1], holder[0] == "queued", peek)
