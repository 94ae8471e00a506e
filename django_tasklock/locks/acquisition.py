"""One hold of a lock: what ``Lock.acquire`` took, in one small object.

``acquire`` makes an ``Acquisition`` when the store gives it the lock; renewal
(``heartbeat``), loss (``loss``), fencing (``fencing``) and liveness
(``liveness``, ``roster``) work on it, never on the ``Lock``'s options. The
``Lock`` keeps its last one (``Lock.acquisition``) after a release or a loss,
for what callers still read then: its token, fence, and how long it was held.
"""

from __future__ import annotations

import time
from _thread import get_ident
from typing import TYPE_CHECKING, Any, Protocol

from ..backends import fork_generation

if TYPE_CHECKING:
    from django.dispatch import Signal

    from ..backends import Hold, LockBackend
    from ..exceptions import LockBackendError

__all__ = ["Acquisition", "Holder", "Kept"]


class Kept(Protocol):
    """What a hold reads of its holder's liveness record (``liveness.Record``)."""

    #: monotonic: until when contenders find the record (renewed in time),
    #: where it is one per server.
    valid_until: float
    #: None where the record is one per server; else (a record beside each
    #: lock, a cluster's) what ``kept_for`` reads.
    by_key: dict[str, tuple[float, float]] | None
    #: ``TASKLOCK['LIVENESS']``.
    bound: float
    #: The holds taken with it, by the id of their Lock.
    held: dict[int, Acquisition]

    def took(self, key: str, sent_at: float, backend: LockBackend) -> float:
        """A take sent at ``sent_at`` wrote the record beside the lock at
        ``key`` (where records live beside each lock); until when it is sure
        there now."""

    def kept_for(self, key: str) -> tuple[float, float]:
        """For the lock at ``key``: until when contenders find the record
        (monotonic, renewed in time), and when a renewal last came too late
        (the record may have lapsed)."""


class Holder(Protocol):
    """What an acquisition needs of the lock it is a hold of (``Lock``)."""

    lock_id: str
    max_hold: float | None
    # Serialises the heartbeat's extend with the holder's release and extend.
    _guard: Any

    def _backend(self) -> tuple[LockBackend, str]: ...

    def _store_error(
        self, backend: LockBackend, key: str, doing: str, exc: BaseException
    ) -> LockBackendError: ...

    def _send(self, signal: Signal, owner: object, **details: object) -> None: ...

    def release_quietly(self) -> None: ...


class Acquisition:
    """One hold of ``lock``: taken at ``key`` in ``alias``'s store through
    ``backend`` (this thread's connection: the holder's release and extend
    reuse it), for ``expire`` seconds, with ``token``.

    ``hold`` is the store's handle on it (None once released or found gone);
    ``valid_until`` (monotonic) when the store may drop it unless extended
    before; ``deadline`` when ``max_hold`` ends it; ``record`` the holder's
    liveness record beside it (None: records off); ``fence`` its fencing token
    once drawn; ``lost`` once known lost, ``reported`` once told (WARNING,
    ``lock_lost``); ``late`` if the store's sure life of it, or of the
    holder's record, had passed when it was taken (a reply come, or a process
    resumed, too late: ``loss.taken_too_late``).
    """

    __slots__ = (
        "acquired_at",
        "alias",
        "backend",
        "deadline",
        "expire",
        "fence",
        "fork",
        "guard",
        "hold",
        "key",
        "late",
        "life",
        "lock",
        "lock_id",
        "lost",
        "record",
        "reported",
        "thread",
        "token",
        "valid_until",
    )

    def __init__(
        self,
        lock: Holder,
        backend: LockBackend,
        alias: str,
        key: str,
        token: str,
        hold: Hold,
        expire: float,
        sent_at: float,
        record: Kept | None,
    ) -> None:
        now = time.monotonic()
        #: The Lock it is a hold of; None once released (a released hold
        #: keeps no reference to its Lock, which keeps it: the two are no
        #: reference cycle the garbage collector must find, per lock taken).
        self.lock: Holder | None = lock
        self.lock_id, self.guard = lock.lock_id, lock._guard
        self.backend, self.alias, self.key = backend, alias, key
        self.token, self.hold, self.expire = token, hold, expire
        self.thread, self.fork = get_ident(), fork_generation[0]
        self.acquired_at, self.record = now, record
        life = backend.lives.get(expire)
        if life is None:
            lives = backend.lives
            if len(lives) >= 64:
                lives.clear()
            life = lives[expire] = backend.shortest_life(expire)
        self.life = life
        # From when the command was sent: the store's clock started no later.
        self.valid_until = valid_until = sent_at + life
        max_hold = lock.max_hold
        self.deadline = None if max_hold is None else now + max_hold
        self.fence: int | None = None
        self.lost = self.reported = False
        # Late: taken after its sure life ran out. (A lock kept for no sure
        # time at all, 2 s or less on memcached, is its caller's choice:
        # check() says so.)
        if record is None:
            self.late = sent_at < valid_until <= now
            return
        # Put back after a restart, listed in the roster; renewed beside the
        # lock (a cluster's) from its next beat on, and sure from the take.
        record.held[id(lock)] = self
        if record.by_key is None:  # (the hot path: no call)
            sure_until = record.valid_until
        else:
            sure_until = record.took(key, sent_at, backend)
        self.late = sent_at < valid_until <= now or now >= sure_until

    def held_for(self) -> float:
        """Seconds since it was taken."""
        return time.monotonic() - self.acquired_at

    def capped(self, seconds: float) -> float:
        """``seconds``, shortened so the lock ends by the max_hold deadline."""
        if self.deadline is None:
            return seconds
        return max(min(seconds, self.deadline - time.monotonic()), 0.001)
