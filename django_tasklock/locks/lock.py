"""``Lock``: an owner-checked lock on one lock id, in Django's cache."""

from __future__ import annotations

import _thread
import logging
import socket
import threading
import time
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
from ..keys import check_lock_id
from ..signals import lock_acquired, lock_contended, lock_released
from .fencing import draw_fence
from .heartbeat import Heartbeat
from .holding import Holding
from .liveness import Record, kept_record
from .loss import (
    held_time,
    lapsed,
    lapsed_why,
    release_failed,
    report_lost,
    take_failed,
)
from .options import (
    ON_LOST_POLICIES,
    OnLost,
    beat_for,
    check_cache,
    misuse,
    owner_for,
    require_hold,
)
from .reads import StoreReads
from .recovery import take_from_dead
from .waiting import POLL_MIN, backoff

if TYPE_CHECKING:
    from django.dispatch import Signal

    from ..backends import Hold, LockBackend

__all__ = ["Lock"]

logger = logging.getLogger("django_tasklock.locks")

_HOSTNAME = socket.gethostname()


class Lock(StoreReads, Holding):
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
    the shortest time the store keeps it: ``expire - 1`` whole seconds on
    memcached, so renewing there needs ``expire >= 2``). ``max_hold``
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
        self.lock_id = check_lock_id(lock_id)
        # Options left out keep the class's defaults below: a Lock is made for
        # every locked call, so it sets only what it was given.
        if expire is not None:
            self._expire = validate_expire(expire)
        if cache is not None:
            self._cache = check_cache(cache)
        if oid is not None:
            self.owner = owner_for(oid, _HOSTNAME)
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
    _hold: Hold | None = None
    _alias: str | None = None
    _key: str | None = None
    _held_backend: LockBackend | None = None
    _holder_thread: int | None = None
    _held_fork = -1
    # When the store may drop the lock unless renewed before (monotonic).
    _valid_until: float | None = None
    _life = 0.0
    _heartbeat: Heartbeat | None = None
    # This process's liveness record beside the lock (None: records off).
    _record: Record | None = None
    _deadline: float | None = None
    _held_expire: float = 0.0
    token: str | None = None
    _fence: int | None = None
    acquired_at: float | None = None
    _lost = _reported = False

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
        state = "lost" if self.lost else "held" if self._hold is not None else "free"
        return f"<Lock {self.lock_id!r} {state}>"

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
        fence = self._fence
        return fence if fence is not None else draw_fence(self)

    @property
    def lost(self) -> bool:
        """True once the lock is known lost: the heartbeat, a release or an extend
        found it gone or someone else's, or the least time the store keeps it ran
        out with no extension since (the store unreachable, or no renewal)."""
        if not self._reported and lapsed(self):
            report_lost(self, "check", lapsed_why(self), clear=False)
        return self._lost

    def _forked(self) -> bool:
        """True in a process forked while this object held the lock."""
        return self._held_fork != fork_generation[0]

    # -- settings read on every use -----------------------------------------------

    @property
    def expire(self) -> float:
        """The expiry in seconds: as passed in, else ``TASKLOCK['LOCK_EXPIRE']``."""
        return self._expire if self._expire is not None else settings.LOCK_EXPIRE

    @property
    def held(self) -> bool:
        """True while this object holds the lock (and has not found it lost)."""
        return self._hold is not None

    @property
    def renewing(self) -> bool:
        """True while a heartbeat keeps this lock alive."""
        heartbeat = self._heartbeat
        return heartbeat is not None and heartbeat.running

    def _capped(self, seconds: float) -> float:
        """``seconds``, shortened so the lock ends by the max_hold deadline."""
        if self._deadline is None:
            return seconds
        return max(min(seconds, self._deadline - time.monotonic()), 0.001)

    # -- acquire -----------------------------------------------------------------

    def acquire(self, *, blocking: bool = False, timeout: float | None = None) -> bool:
        """Take the lock; True if this call took it, False if someone else holds it.

        With ``blocking=True`` it tries again, with growing pauses, until it gets
        the lock or ``timeout`` seconds (None: no limit) have passed. Raises
        ``LockBackendError`` when the store cannot be reached: the caller must not
        run the protected code then.
        """
        if self._hold is not None or (timeout is not None and not blocking):
            raise misuse(self)
        default_expire, default_alias, protocol, default_renew, liveness = (
            settings.lock_defaults()
        )
        expire = self._expire if self._expire is not None else default_expire
        if self.max_hold is not None:
            expire = min(expire, self.max_hold)
        renew = self._renew_option if self._renew_option is not None else default_renew
        alias = self._cache or default_alias
        backend = backend_for(alias, protocol=protocol)
        key = backend.keys_for(self.lock_id)[0]
        beat = beat_for(backend, expire) if renew else 0.0
        started = time.monotonic()
        record, make_token = kept_record(alias, liveness, backend, started, key)
        deadline = None if timeout is None else started + timeout
        pause = POLL_MIN
        tried_at = started
        while True:
            token = make_token(self.owner)
            try:
                if self._take_over is None:
                    hold = backend.acquire(key, token, expire)
                else:
                    hold = backend.take_over(key, self._take_over, token, expire)
                # Refused: look at its holder when due (the test is here, not
                # in the call, as it fails on all but one refusal in many).
                if hold is None and backend.looks.get(key, 0.0) <= tried_at:
                    hold = take_from_dead(self, backend, key, token, expire)
            except backend.errors as exc:
                raise take_failed(self, backend, key, token, exc) from exc
            if hold is not None:
                now = time.monotonic()
                self._hold, self._fence = hold, None
                self._alias, self._key, self.token = alias, key, token
                # Release and extend in this thread reuse this backend (the same
                # connection); another thread looks its own up.
                self._held_backend, self._holder_thread = backend, threading.get_ident()
                self._held_fork, self._record = fork_generation[0], record
                if record is not None:
                    record.held[id(self)] = self
                self.acquired_at, self._held_expire = now, expire
                self._lost = self._reported = False
                self._life = backend.shortest_life(expire)
                self._valid_until = tried_at + self._life
                self._deadline = None if self.max_hold is None else now + self.max_hold
                if renew:
                    self._heartbeat = Heartbeat(self, beat)
                    self._heartbeat.start()
                if lock_acquired.receivers:
                    self._send(lock_acquired, token, fence=None, waited=now - started)
                return True
            now = time.monotonic()
            next_pause = backoff(pause, deadline, now) if blocking else None
            if next_pause is None:
                if lock_contended.receivers:
                    self._send_contended(backend, key, now - started)
                return False
            pause, tried_at = next_pause, time.monotonic()

    def hand_over(self, value: str, expire: float) -> bool:
        """Store ``value`` in place of this holder's token, in one conditional
        write, and stop holding: how a running call's lock becomes its retry's.

        True if the store had this holder's lock and now has ``value``. Raises
        ``LockBackendError`` if the store cannot be reached (the lock is then
        kept, and released as usual).
        """
        require_hold(self, "hand_over()")
        self._stop_heartbeat()
        with self._guard:
            if self._hold is None:
                return False
            backend, key = self._backend()
            assert self.token is not None
            try:
                replaced = backend.replace(key, self._hold, self.token, value, expire)
            except backend.errors as exc:
                raise self._store_error(
                    backend, key, "hand the lock over", exc
                ) from exc
            self._hold = None
            if replaced is None:
                report_lost(self, "hand over")
                return False
        return True

    def _report_lost(self, doing: str) -> None:
        report_lost(self, doing)

    def _send_contended(self, backend: LockBackend, key: str, waited: float) -> None:
        try:
            peek = backend.peek(key)
        except backend.errors:
            peek = None
        self._send(lock_contended, None if peek is None else peek.value, waited=waited)

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
        the store cannot be reached; the lock then stays until it expires.
        """
        if self._hold is None or self._held_fork != fork_generation[0]:
            require_hold(self, "release()")
        if self._heartbeat is not None:
            self._stop_heartbeat()
        with self._guard:
            if self._hold is None:  # lost earlier, and reported then
                return False
            backend, key = self._backend()
            hold, token = self._hold, self.token
            assert token is not None
            try:
                released = backend.release(key, hold, token)
            except backend.errors as exc:
                self._hold = None
                raise self._store_error(
                    backend, key, release_failed(self, backend, key, token, exc), exc
                ) from exc
            if not released:
                report_lost(self, "release")
                return False
            self._hold = None
            if self._record is not None:  # forgotten now, not at the next beat
                self._record.held.pop(id(self), None)
        if lock_released.receivers:
            self._send(lock_released, token, fence=self._fence, held=held_time(self))
        return True

    def extend(self, seconds: float | None = None) -> bool:
        """Reset the lock's expiry to ``seconds`` from now (default: ``expire``),
        never past ``max_hold`` after it was taken.

        Acts only while this object owns the lock: True if extended, False (and a
        WARNING and ``lock_lost``) if the lock was lost.
        """
        require_hold(self, "extend()")
        if seconds is not None:
            validate_expire(seconds, name="seconds")
        with self._guard:
            return self._extend(seconds, "extend")

    def _extend(self, seconds: float | None, doing: str) -> bool:
        if self._hold is None:
            return False
        expire = self._capped(self._held_expire if seconds is None else seconds)
        backend, key = self._backend()
        assert self.token is not None
        sent_at = time.monotonic()
        try:
            hold = backend.extend(key, self._hold, self.token, expire)
        except backend.errors as exc:
            raise self._store_error(backend, key, "extend the lock", exc) from exc
        if hold is None:
            report_lost(self, doing)
            return False
        self._hold = hold
        self._life = backend.shortest_life(expire)
        self._valid_until = sent_at + self._life
        return True

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
            raise LockLost(self.lock_id, held_time(self))
        return False

    # -- context manager -----------------------------------------------------------

    def release_quietly(self) -> None:
        """Release, logging instead of raising if the store fails.

        For ``finally`` blocks: a failed release must not hide the protected
        code's own result or exception. In a forked child it leaves the lock to
        the parent that holds it.
        """
        if self._hold is None:
            self._stop_heartbeat()
            return
        if self._held_fork != fork_generation[0]:  # self._forked(), inlined
            logger.debug(
                "Lock %r is left to the process that holds it (this is a fork)",
                self.lock_id,
            )
            return
        try:
            self.release()
        except LockBackendError:
            logger.exception("Could not release lock %r", self.lock_id)
