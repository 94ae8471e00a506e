"""``Lock``: an owner-checked lock on one lock id, in Django's cache."""

from __future__ import annotations

import _thread
import contextlib
import logging
import socket
import time
from _thread import get_ident
from typing import TYPE_CHECKING

from ..backends import backend_for, fork_generation
from ..conf import (
    settings,
    validate_bool,
    validate_choice,
    validate_expire,
    validate_seconds,
)
from ..exceptions import LockBackendError, LockLost
from ..keys import FENCE_PREFIX, check_lock_id
from ..signals import lock_released
from ..tokens import new_live_token, new_token
from .acquisition import Acquisition
from .asynchronous import AsyncLocking
from .fencing import draw_fence, fence_to_write
from .holding import Holding
from .holds import extend_hold, hand_over_hold
from .line import (
    WAITING_HERE,
    Place,
    first_place,
    left_line,
    place_for,
    wait_here,
    wake_here,
)
from .liveness import record_beside
from .loss import held_time, lapsed, lapsed_why, report_lost, take_failed
from .reads import StoreReads
from .recovery import take_from_dead
from .taking import (
    after_refusal,
    hold_taken,
    release_error,
    take_settings,
)
from .validation import (
    ON_LOST_POLICIES,
    OnLost,
    beat_for,
    check_cache,
    owner_for,
    require_hold,
)
from .waiting import POLL_MIN

if TYPE_CHECKING:
    from django.dispatch import Signal

    from ..backends import LockBackend
    from ..backends.capabilities import Hold
    from .heartbeat import Heartbeat


__all__ = ["Lock"]

logger = logging.getLogger(__name__)

_HOSTNAME = socket.gethostname()


#: oid -> the owner written at the start of its tokens (owner_for), for
#: the few oids a process uses: checked once each, not on every Lock.
_OWNERS: dict[str, str] = {}


def _owner(oid: object) -> str:
    """``owner_for(oid)`` on this host, kept for the next Lock of ``oid``."""
    owner = owner_for(oid, _HOSTNAME)
    if len(_OWNERS) < 64 and type(oid) is str:
        _OWNERS[oid] = owner
    return owner


class Lock(StoreReads, Holding, AsyncLocking):
    """An owner-checked lock on one lock id, in the cache ``TASKLOCK['CACHE']`` names.

    Each acquisition stores a fresh random token, so two Lock objects (two threads,
    two processes, two workers) are always two different owners, and ``release()``
    and ``extend()`` act only while this object still owns the lock::

        lock = Lock(f"{self.name}-lock-{digest}", expire=300)
        if lock.acquire():
            try:
                do_the_work(fence=lock.fence)
            finally:
                lock.release()

    or, raising ``LockNotAcquired`` when someone else holds it::

        with Lock("nightly-report", expire=30, renew=True):
            do_the_work()

    ``expire`` (seconds, 0 < expire <= 30 days) defaults to
    ``TASKLOCK['LOCK_EXPIRE']`` and ``cache`` (a CACHES alias) to
    ``TASKLOCK['CACHE']``, both read when the lock is acquired. ``oid`` is written
    into the stored token for people reading the store (Celery's ``app.oid``);
    it plays no part in the owner check. ``call_id`` (a task id) is written into
    the tokens too, after a ``#``: it tells a second delivery of a call's message
    from a new call. ``take_over``: a value the store may hold under the lock id
    (a queued call's mark) that ``acquire()`` replaces as if the lock were free,
    in one conditional write.

    ``renew`` (default ``TASKLOCK['RENEW']``): while held, a heartbeat thread
    extends the lock, owner-checked, every third of its expiry, so a short expiry
    frees the lock soon after a crash while a long holder keeps it (a third of
    the shortest time the store keeps it: ``expire - 2`` whole seconds on
    memcached, so renewing there needs ``expire >= 3``). ``max_hold``
    (seconds): the lock never lasts longer than this after it was taken, renewed
    or not. When the lock is found lost (by the heartbeat, ``extend()`` or
    ``release()``), ``lost`` becomes True, a WARNING is logged and ``lock_lost`` is
    sent; with ``on_lost="raise"``, ``check()`` then raises ``LockLost``.

    ``fence`` is this acquisition's fencing token, an integer larger than that of
    every earlier acquisition of the same lock id whose token was read, drawn on
    first read: pass it with writes so the protected resource can refuse a
    holder that lost the lock (see the docs, Long tasks: fencing tokens).

    A lock is lost, too, once the least time the store is sure to keep it has
    passed since it was taken or last extended: a renewing holder whose store
    stayed unreachable that long is told so then, not when the store is back.

    A Lock object belongs to one holder: do not share it between threads (its own
    heartbeat aside). A process forked while it holds the lock is not its owner:
    there ``release()`` and ``extend()`` raise ``LockUsageError``, a ``with`` block
    unwinding leaves the lock to the parent, and reads (``owned()``, ``ttl()``,
    ``locked()``, ``check()``, ``fence``) use the child's own connections.
    """

    def __init__(
        self,
        lock_id: str,
        *,
        expire: float | None = None,
        cache: str | None = None,
        oid: str | None = None,
        renew: bool | None = None,
        max_hold: float | None = None,
        on_lost: OnLost = "warn",
        call_id: str | None = None,
        take_over: str | None = None,
    ) -> None:
        # check_lock_id()'s tests, inlined for the common id: called, a Lock
        # cycle took 0.6 % more instructions and an @single_instance call
        # 0.4 % (make bench-cpu), past that row's 2 % budget.
        if type(lock_id) is str and lock_id and not lock_id.startswith(FENCE_PREFIX):
            self.lock_id = lock_id
        else:
            self.lock_id = check_lock_id(lock_id)
        # Options left out keep the class's defaults below (set per Lock).
        if expire is not None:
            self._expire = validate_expire(expire)
        if cache is not None:
            self._cache = check_cache(cache)
        if oid is not None:
            self.owner = (type(oid) is str and _OWNERS.get(oid)) or _owner(oid)
        if renew is not None:
            self._renew_option = validate_bool(renew, name="renew")
        if max_hold is not None:
            self.max_hold = validate_seconds(max_hold, name="max_hold")
        if on_lost != "warn":
            self.on_lost = validate_choice(  # type: ignore[assignment]
                on_lost, name="on_lost", choices=ON_LOST_POLICIES
            )
        if call_id is not None:
            self.owner += "#" + call_id
            self.call_id = call_id
        if take_over is not None:
            self._take_over = take_over
        # Serialises the heartbeat's extend with the holder's release and extend;
        # reentrant, so a lock_lost receiver may call release() on this lock.
        self._guard = _thread.RLock()

    # What a Lock starts with (see __init__).
    _expire: float | None = None
    _cache: str | None = None
    _renew_option: bool | None = None
    max_hold: float | None = None
    on_lost: OnLost = "warn"
    #: Who this holder is, as written at the start of its tokens.
    owner: str = _HOSTNAME
    _heartbeat: Heartbeat | None = None

    #: The task id of the call holding it, written into its tokens.
    call_id: str | None = None
    #: What the lock console shows of it: the run (``runs.Run``) or a
    #: ``(task name, args, kwargs)`` triple that took it, if any.
    about: object = None
    #: The semaphore this lock is a slot of, if any.
    slot_of: str | None = None
    # A value the store may hold that acquire() takes over as if the lock were
    # free, in one conditional write; None: take the lock only if free.
    _take_over: str | None = None

    def __repr__(self) -> str:
        state = "lost" if self.lost else "held" if self.held else "free"
        return f"<Lock {self.lock_id!r} {state}>"

    @property
    def acquisition(self) -> Acquisition | None:
        """This lock's hold (``locks.acquisition.Acquisition``): the current
        one, else the last (released or lost); None before the first acquire."""
        return self._acq

    @property
    def token(self) -> str | None:
        """The token stored by the last acquisition (None before the first)."""
        acq = self._acq
        return None if acq is None else acq.token

    @property
    def acquired_at(self) -> float | None:
        """When (``time.monotonic()``) the last acquisition took the lock."""
        acq = self._acq
        return None if acq is None else acq.acquired_at

    @property
    def fence(self) -> int | None:
        """This acquisition's fencing token: larger than that of every earlier
        acquisition of this lock id whose token was read, smaller than every
        later one's. Pass it with writes (see the docs, Long tasks: fencing tokens).

        Drawn from the lock's counter on first read, while the store confirms the
        lock is still this holder's (one round trip; a lock whose fence is never
        read leaves no counter behind). None if this object never held the lock;
        raises ``LockLost`` if the lock was lost before a token was drawn (a
        write must not go out unfenced then), and ``LockBackendError`` if the
        store cannot be reached.
        """
        acq = self._acq
        if acq is None:
            return None
        fence = acq.fence
        return fence if fence is not None else draw_fence(acq)

    def held_fence(self) -> int:
        """``fence``, for a write now: raises ``LockLost`` once the lock is
        known lost (``lost``), and ``LockUsageError`` if this object holds no
        lock (never taken, or released)."""
        return fence_to_write(self)

    @property
    def lost(self) -> bool:
        """True once the lock is known lost: the heartbeat, a release or an extend
        found it gone or someone else's, or the least time the store keeps it ran
        out with no extension since (the store unreachable, or no renewal)."""
        acq = self._acq
        if acq is None:
            return False
        if not acq.reported and lapsed(acq):
            report_lost(acq, "check", lapsed_why(acq), clear=False)
        return acq.lost

    # -- settings read on every use -----------------------------------------------

    @property
    def expire(self) -> float:
        """The expiry in seconds: as passed in, else ``TASKLOCK['LOCK_EXPIRE']``."""
        return self._expire if self._expire is not None else settings.LOCK_EXPIRE

    @property
    def held(self) -> bool:
        """True while this object holds the lock (and has not found it lost)."""
        acq = self._acq
        return acq is not None and acq.hold is not None

    @property
    def renewing(self) -> bool:
        """True while a heartbeat keeps this lock alive."""
        heartbeat = self._heartbeat
        return heartbeat is not None and heartbeat.running

    # -- acquire -----------------------------------------------------------------

    def acquire(self, *, blocking: bool = False, timeout: float | None = None) -> bool:
        """Take the lock: True if this call took it, False if someone else holds
        it; ``blocking=True`` tries again, with growing pauses, until it is taken
        or ``timeout`` seconds (None: no limit) have passed. Raises
        ``LockBackendError`` if the store cannot be reached: do not run then.

        Its decisions are ``taking``'s, shared with ``aacquire``."""
        expire, alias, protocol, renew, bound = take_settings(self, blocking, timeout)
        backend = backend_for(alias, protocol=protocol)
        key = backend.keys_for(self.lock_id)[0]
        beat = beat_for(backend, expire) if renew else None
        tried_at = started = time.monotonic()
        # This process's liveness record beside the lock, written first when
        # due: contenders on other hosts judge a holder by it.
        record = record_beside(alias, bound, backend, key, started)
        make_token = new_token if record is None else new_live_token
        deadline = None if timeout is None else started + timeout
        pause = POLL_MIN if blocking else None
        # In the lock's line once refused (or at once: KeepsLines.guards_takes).
        place = first_place(backend, key, self._take_over) if blocking else None
        while True:
            token = make_token(self.owner)
            try:
                if place is None and self._take_over is None:  # (the hot path)
                    hold = backend.acquire(key, token, expire)
                    if hold is None and backend.looks.get(key, 0.0) <= tried_at:
                        hold = take_from_dead(self.lock_id, backend, key, token, expire)
                else:
                    hold = _take_once(
                        self, backend, key, token, expire, tried_at, place
                    )
            except backend.errors as exc:
                left_line(place)
                raise take_failed(self, alias, backend, key, token, exc) from exc
            if hold is not None:
                taken = Acquisition(
                    self, backend, alias, key, token, hold, expire, tried_at, record
                )
                if hold_taken(self, taken, beat, started):
                    return True
                with contextlib.suppress(*backend.errors):  # refused
                    backend.release(key, hold, token)
                if tried_at == started:  # the first take late: again at once
                    tried_at = time.monotonic()
                    continue
            wait = after_refusal(self, backend, key, pause, deadline, started)
            if wait is None:
                if place is not None:
                    place.leave()
                return False
            if place is not None:
                place.wait(deadline)
            elif (place := place_for(backend, key, blocking, self._take_over)) is None:
                wait_here(alias, key, token, wait[0])  # (in line: tried at once)
            pause, tried_at = wait[1], time.monotonic()

    def hand_over(self, value: str, expire: float) -> bool:
        """Store ``value`` in place of this holder's token, in one conditional
        write, and stop holding: how a running call's lock becomes its retry's.

        True if the store had this holder's lock and now has ``value``. Raises
        ``LockBackendError`` if the store cannot be reached (the lock is then
        kept, and released as usual).
        """
        acq = require_hold(self.lock_id, self._acq, "hand_over()")
        self._stop_heartbeat()
        return hand_over_hold(acq, value, expire)

    def _send(self, signal: Signal, owner: object, **details: object) -> None:
        """Send ``signal`` about this lock; a receiver that raises is logged by
        Django and never breaks the lock."""
        signal.send_robust(
            Lock, lock=self, lock_id=self.lock_id, owner=owner, **details
        )

    # -- release and extend --------------------------------------------------------

    def _stop_heartbeat(self) -> None:
        heartbeat, self._heartbeat = self._heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()

    def release(self) -> bool:
        """Remove the lock if this object still owns it; True if it did.

        Stops the heartbeat first. A lock found gone or owned by someone else is
        left alone and reported (WARNING, ``lock_lost``: the protected work may
        have overlapped), and False is returned. Raises ``LockBackendError`` if
        the store cannot be reached; the lock then stays until it expires."""
        acq = self._acq
        if acq is None or acq.hold is None or acq.fork != fork_generation[0]:
            acq = require_hold(self.lock_id, acq, "release()")
        if self._heartbeat is not None:
            self._stop_heartbeat()
        with acq.guard:
            hold, token = acq.hold, acq.token
            if hold is None:  # lost earlier, and reported then
                return False
            here = acq.thread == get_ident()  # (a fork was refused above)
            backend, key = (acq.backend, acq.key) if here else self._backend()
            try:
                released = backend.release(key, hold, token)
            except backend.errors as exc:
                raise release_error(self, acq, backend, key, exc) from exc
            if not released:
                report_lost(acq, "release")
                return False
            acq.hold = acq.lock = None  # no cycle left (see Acquisition.lock)
            if acq.record is not None:  # forgotten now, not at the next beat
                acq.record.held.pop(id(self), None)
            if WAITING_HERE:  # this process's waiters on it woken at once
                wake_here(acq.alias, key)
        if lock_released.receivers:
            self._send(lock_released, token, fence=acq.fence, held=acq.held_for())
        return True

    def extend(self, seconds: float | None = None) -> bool:
        """Reset the lock's expiry to ``seconds`` from now (default: ``expire``),
        never past ``max_hold`` after it was taken.

        Acts only while this object owns the lock: True if extended, False (and a
        WARNING and ``lock_lost``) if the lock was lost.
        """
        acq = require_hold(self.lock_id, self._acq, "extend()")
        if seconds is not None:
            validate_expire(seconds, name="seconds")
        with self._guard:
            return extend_hold(acq, seconds, "extend")

    def check(self) -> bool:
        """True while the lock is not known to be lost. Costs no round trip.

        Lost means found gone or someone else's (by the heartbeat, an extend or a
        release), or past the least time the store keeps it since it was taken or
        last extended (a store that stayed unreachable, or a lock that does not
        renew), judged by the clock here. With ``on_lost="raise"``, a lost lock
        raises ``LockLost`` instead of returning False. Call it between steps of
        long work, with ``renew=True``.
        """
        if not self.lost:
            return True
        if self.on_lost == "raise":
            assert self._acq is not None
            raise LockLost(self.lock_id, held_time(self._acq))
        return False

    # -- context manager -----------------------------------------------------------

    def release_quietly(self) -> None:
        """Release, logging instead of raising if the store fails.

        For ``finally`` blocks: a failed release must not hide the protected
        code's own result or exception. In a forked child it leaves the lock to
        the parent that holds it.
        """
        acq = self._acq
        if acq is None or acq.hold is None:
            self._stop_heartbeat()
            return
        if acq.fork != fork_generation[0]:
            logger.debug(
                "Lock %r is left to the process that holds it (this is a fork)",
                self.lock_id,
            )
            return
        try:
            self.release()
        except LockBackendError:
            logger.exception("Could not release lock %r", self.lock_id)


def _take_once(
    lock: Lock,
    backend: LockBackend,
    key: str,
    token: str,
    expire: float,
    tried_at: float,
    place: Place | None,
) -> Hold | None:
    """One try of ``lock.acquire`` off its hot path: in the lock's line
    (``place``) or a take-over; then, when due, the lock taken from its holder
    if that one is dead (``locks.recovery``), which takes the waiter out of
    the line."""
    if place is not None:
        hold = place.take(token, expire)
    else:
        assert lock._take_over is not None
        hold = backend.take_over(key, lock._take_over, token, expire)
    if hold is None and backend.looks.get(key, 0.0) <= tried_at:
        free_too = place is None or place.lines.guards_takes
        hold = take_from_dead(lock.lock_id, backend, key, token, expire, free_too)
        if hold is not None:
            left_line(place)
    return hold
