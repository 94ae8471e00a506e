"""Reading a lock from outside its holder, and clearing a stale one.

What ``python manage.py tasklock`` is built on; usable from a project's own admin
views and health checks too.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from .backends import LockBackend, backend_for
from .conf import settings
from .exceptions import LockBackendError
from .keys import check_lock_id
from .locks.recovery import judge
from .parking import ParkLine
from .tokens import local_verdict, token_host, token_owner, token_process

__all__ = [
    "LockChanged",
    "LockStatus",
    "Owner",
    "ParkStatus",
    "expiry_text",
    "force_release",
    "holder_text",
    "lock_status",
    "park_status",
    "release_refusal",
    "remove",
    "semaphore_status",
]


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who a stored django_tasklock token says holds a lock.

    ``alive`` is True or False when the holder could be judged (its process on
    this host looked up in /proc, or, on another host, its liveness record read
    from the store), None when it cannot be; ``why`` says how it was judged.
    """

    name: str
    host: str
    pid: int
    alive: bool | None
    why: str = ""

    @classmethod
    def parse(
        cls, value: object, verdict: tuple[bool | None, str] | None = None
    ) -> Owner | None:
        """The owner in a token ``owner:process:random:thread:count``, where
        owner is ``oid@host`` or ``host``; None for any other value (the
        recipe's oid). ``verdict``: what ``locks.recovery.judge`` said of it,
        else it is judged on this host alone."""
        parsed = token_owner(value)
        if parsed is None:
            return None
        name, pid = parsed
        host = token_host(name)
        if verdict is None:
            process = token_process(value)
            assert process is not None
            verdict = local_verdict(host, process[1])
        return cls(name=name, host=host, pid=pid, alive=verdict[0], why=verdict[1])

    def describe(self) -> str:
        state = {True: "alive", False: "dead", None: "unknown"}[self.alive]
        return f"process {self.pid} on {self.host} ({state}: {self.why})"


@dataclasses.dataclass(frozen=True)
class LockStatus:
    """A lock as its store holds it now.

    ``value`` is the stored token (or whatever other code stored under the key);
    ``ttl`` the seconds left (memcached counts whole seconds; ``inf``: never
    expires); ``fence`` the last fencing token drawn for the lock id (None when
    its counter is gone; the next one then starts from the clock). ``remove()``
    takes it to remove the very item that was read, and nothing else.
    """

    lock_id: str
    store: str
    key: str
    held: bool
    value: object
    ttl: float | None
    fence: int | None
    cache: str | None = None
    #: The backend's hold on the item read (its CAS id on memcached).
    hold: object = dataclasses.field(default=None, repr=False, compare=False)
    #: Whether the holder lives, and why (``locks.recovery.judge``); None
    #: when free.
    verdict: tuple[bool | None, str] | None = dataclasses.field(
        default=None, repr=False, compare=False
    )

    @property
    def owner(self) -> Owner | None:
        return Owner.parse(self.value, self.verdict)

    @property
    def call(self) -> tuple[str, str] | None:
        """``(state, task id)`` of the Celery call holding it: ``"queued"``
        (published, not started), ``"started"`` (until_started) or
        ``"running"``; None if the holder is not a task call."""
        from .calls import call_of

        return call_of(self.value) if self.held else None

    @property
    def stale(self) -> bool:
        """True if its holder is dead: its process on this host no longer runs,
        or, on another host, its liveness record is gone."""
        owner = self.owner
        return self.held and owner is not None and owner.alive is False

    def as_dict(self) -> dict[str, Any]:
        owner = self.owner
        return {
            "lock_id": self.lock_id,
            "store": self.store,
            "key": self.key,
            "held": self.held,
            "owner": None if self.value is None else str(self.value),
            "holder": None if owner is None else dataclasses.asdict(owner),
            "stale": self.stale,
            "call": None
            if (call := self.call) is None
            else {"state": call[0], "task_id": call[1]},
            "ttl": self.ttl,
            "fence": self.fence,
        }


class LockChanged(LockBackendError):
    """The lock was released, expired or taken by another owner while a forced
    release was about to remove it; nothing was removed."""


def _backend(lock_id: str, cache: str | None) -> tuple[LockBackend, str]:
    backend = backend_for(cache or settings.CACHE)
    return backend, backend.keys_for(check_lock_id(lock_id))[0]


def lock_status(lock_id: str, *, cache: str | None = None) -> LockStatus:
    """Read ``lock_id`` from the store (``cache`` alias, default TASKLOCK['CACHE']).

    Raises ``LockBackendError`` when the store cannot be reached.
    """
    backend, key = _backend(lock_id, cache)
    try:
        peek = backend.peek(key)
        try:
            ttl = backend.ttl(key) if peek is not None else None
        except backend.errors:
            ttl = None  # memcached before 1.6 cannot tell
        fence = backend.last_fence(key, backend.keys_for(lock_id)[1])
        verdict = None if peek is None else judge(peek.value, backend, key)
    except backend.errors as exc:
        raise LockBackendError(
            f"Could not read the lock: {type(exc).__name__}: {exc}",
            lock_id=lock_id,
            store=backend.describe(key),
        ) from exc
    return LockStatus(
        lock_id=lock_id,
        store=backend.describe(key),
        key=key,
        held=peek is not None,
        value=None if peek is None else peek.value,
        ttl=ttl,
        fence=fence,
        cache=cache,
        hold=None if peek is None else peek.hold,
        verdict=verdict,
    )


def remove(status: LockStatus) -> bool:
    """Remove the lock ``status`` read, only if the store still holds that very
    item; True if it was removed, False if it was released, expired or taken by
    another owner since (then nothing is removed).

    So a decision made on ``status`` (say, that its holder is gone) and the
    removal act on one item. On memcached both the stored value and the item's
    CAS id must still match; on Redis and LocMem the stored value must (a
    django_tasklock token is unique per acquisition; a value other code stores
    every time, such as the recipe's oid, is told apart on memcached only).
    """
    if not status.held:
        return False
    backend, key = _backend(status.lock_id, status.cache)
    try:
        return backend.release(key, status.hold, status.value)
    except backend.errors as exc:
        raise LockBackendError(
            f"Could not release the lock: {type(exc).__name__}: {exc}",
            lock_id=status.lock_id,
            store=backend.describe(key),
        ) from exc


def force_release(lock_id: str, *, cache: str | None = None) -> LockStatus | None:
    """Remove the lock whoever holds it; return what was removed, None if free.

    Removes only the very item it read: if the lock changes hands in between,
    nothing is removed and ``LockChanged`` is raised. A holder that still runs
    finds its lock lost at its next renewal, extend or release (WARNING,
    ``lock_lost``), and its fenced writes are refused once the next holder wrote.
    """
    status = lock_status(lock_id, cache=cache)
    if not status.held:
        return None
    if not remove(status):
        raise LockChanged(
            "The lock was released, expired or taken by another owner while it was "
            "being released; nothing was removed. Look at its status again",
            lock_id=lock_id,
            store=status.store,
        )
    return status


def semaphore_status(
    name: str, limit: int, *, cache: str | None = None
) -> list[LockStatus]:
    """The status of each of the ``limit`` slots of the semaphore ``name``.

    A held slot's status names its holder, token, time left and last fence;
    ``remove()`` takes it like a lock's.
    """
    from .semaphores import slot_id, validate_limit

    validate_limit(limit)
    return [lock_status(slot_id(name, slot), cache=cache) for slot in range(limit)]


_PENDING = {
    "queued": "a call published and not started yet (no process holds it); it "
    "expires after its countdown plus QUEUE_EXPIRE",
    "started": "a call a worker started (until_started: new calls may be sent)",
    "running": "a call a worker runs",
}


def holder_text(status: LockStatus) -> str:
    """Who holds a held lock, in words."""
    owner = status.owner
    if owner is not None:
        return owner.describe()
    call = status.call
    if call is not None:
        return _PENDING[call[0]]
    return "not a django_tasklock token (other code)"


def expiry_text(ttl: float | None) -> str:
    """When a lock with ``ttl`` seconds left expires, in words."""
    if ttl is None:
        return "unknown"
    if math.isinf(ttl):
        return "never (stored without a timeout by other code)"
    return f"in {ttl:.0f}s" if ttl >= 1 else f"in {ttl:.2f}s"


def release_refusal(status: LockStatus, *, force: bool, how: str) -> str | None:
    """Why ``status``'s lock may not be released, None if it may: a lock whose
    holder is gone (``stale``) may, any other only when forced. ``how`` says how
    to force it (``"Pass --force"``), at the start of a sentence."""
    lock_id = status.lock_id
    if not status.held:
        return f"Lock {lock_id!r} is not held; nothing to release."
    if force or status.stale:
        return None
    call = status.call
    if status.owner is None and call is not None and call[0] == "queued":
        return (
            f"Lock {lock_id!r} holds call {call[1]}, published and not started "
            f"yet; it expires {expiry_text(status.ttl)} (its countdown plus "
            "QUEUE_EXPIRE). Its message may still be in the queue: releasing it "
            f"lets an identical call be sent beside it. {how} only if the "
            "message is gone (a purged queue)."
        )
    if status.owner is None and call is None:
        holder = "not a django_tasklock token: no process to look at"
    else:
        holder = holder_text(status)
    return (
        f"Lock {lock_id!r} is held by {status.value} ({holder}), expiring "
        f"{expiry_text(status.ttl)}. Its holder may still be running: releasing "
        f"it lets a second run start beside it. {how} to release it anyway."
    )


@dataclasses.dataclass(frozen=True)
class ParkStatus:
    """The park line of a lock (``on_contention="park"``): its calls by task
    id, with the seconds each has been parked or promoted."""

    lock_id: str
    parked: list[tuple[str, float]]
    promoted: list[tuple[str, float]]
    running: list[str]

    @property
    def empty(self) -> bool:
        return not (self.parked or self.promoted or self.running)

    def as_dict(self) -> dict[str, Any]:
        return {
            "lock_id": self.lock_id,
            "parked": [{"task_id": c, "waited": round(w, 3)} for c, w in self.parked],
            "promoted": [{"task_id": c, "for": round(w, 3)} for c, w in self.promoted],
            "running": self.running,
        }


def park_status(lock_id: str, *, cache: str | None = None) -> ParkStatus:
    """The park line of ``lock_id`` as its store holds it (one read; empty
    where the lock has none). Raises ``LockBackendError``."""
    line = ParkLine(check_lock_id(lock_id), cache, 1.0).read()
    now = time.time()
    return ParkStatus(
        lock_id,
        [(entry[0], now - entry[1]) for entry in line.parked],
        [(call_id, now - at) for call_id, (at, _by) in line.promoted.items()],
        sorted(line.running),
    )
