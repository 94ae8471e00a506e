"""``Lock`` and ``memcache_lock``: owner-checked task locks on Django's cache."""

from __future__ import annotations

import _thread
import logging
import os
import random
import socket
import threading
import time
from typing import TYPE_CHECKING, Final, Literal, TypeVar

from . import pending
from .backends import backend_for, fork_generation
from .conf import (
    settings,
    validate_bool,
    validate_choice,
    validate_expire,
    validate_seconds,
)
from .exceptions import LockBackendError, LockLost, LockNotAcquired, LockUsageError
from .keys import check_lock_id
from .renewal import Heartbeat
from .signals import lock_acquired, lock_contended, lock_lost, lock_released
from .tokens import fence_counter, new_token, token_owner

if TYPE_CHECKING:
    from types import TracebackType

    from django.dispatch import Signal

    from .backends import Hold, LockBackend

__all__ = ["Lock", "OnLost", "memcache_lock"]

OnLost = Literal["warn", "raise"]
ON_LOST_POLICIES: Final = ("warn", "raise")
#: The shortest heartbeat interval: renewing more often than this is refused.
MIN_BEAT: Final = 0.1

logger = logging.getLogger(__name__)

_HOSTNAME = socket.gethostname()


# Orders the flags of a loss report (rare) between a holder's threads; one for
# every lock, rather than one more allocation per Lock.
_REPORT_GUARD = threading.Lock()


def _new_report_guard() -> None:
    global _REPORT_GUARD
    _REPORT_GUARD = threading.Lock()  # it may have been held at the fork


os.register_at_fork(after_in_child=_new_report_guard)

#: Shortest and longest pause between two tries of a blocking acquire.
POLL_MIN = 0.01
POLL_MAX = 0.5


def backoff(pause: float, deadline: float | None, now: float) -> float | None:
    """Wait before a blocking acquire's next try: a random time up to ``pause``,
    never past ``deadline``. The next try's pause, or None (without waiting) once
    the deadline has passed."""
    if deadline is not None and now >= deadline:
        return None
    sleep = random.uniform(pause / 2, pause)
    time.sleep(sleep if deadline is None else min(sleep, deadline - now))
    return min(pause * 2, POLL_MAX)


#: The longest oid kept in a token: it is for people reading the store.
MAX_OID = 200


def check_oid(oid: object) -> str:
    """Return ``oid`` if it can be written into a stored token, else raise."""
    if not isinstance(oid, str):
        raise TypeError(f"oid must be a str, not {type(oid).__name__}.")
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
        raise ValueError(
            f"oid {oid[:40]!r} cannot be stored in a lock's token: {problem}. Pass "
            "a short name of the holder (Celery's app.oid), or leave oid out."
        )
    return oid


_Holder = TypeVar("_Holder", bound="Holding")


class Holding:
    """The ``with`` statement of Lock and Semaphore: acquire without waiting or
    raise ``LockNotAcquired``; release quietly on the way out."""

    lock_id: str

    def acquire(self, *, blocking: bool = False, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def release_quietly(self) -> None:
        raise NotImplementedError

    def __enter__(self: _Holder) -> _Holder:
        if not self.acquire():
            raise LockNotAcquired(self.lock_id)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release_quietly()


class Lock(Holding):
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
    it plays no part in the owner check.

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
    holder that lost the lock (see README, Fencing).

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
    ) -> None:
        self.lock_id = check_lock_id(lock_id)
        # Options left out keep the class's defaults below: a Lock is made for
        # every locked call, so it sets only what it was given.
        if expire is not None:
            self._expire = validate_expire(expire)
        if cache is not None:
            if not isinstance(cache, str) or not cache:
                raise TypeError(
                    f"cache must be the name of a CACHES entry, not {cache!r}."
                )
            self._cache = cache
        if oid is not None:
            if oid:
                self.owner = f"{check_oid(oid)}@{_HOSTNAME}"
            elif not isinstance(oid, str):
                raise TypeError(f"oid must be a str, not {type(oid).__name__}.")
        if renew is not None:
            self._renew_option = validate_bool(renew, name="renew")
        if max_hold is not None:
            self.max_hold = validate_seconds(max_hold, name="max_hold")
        if on_lost != "warn":
            self.on_lost = validate_choice(  # type: ignore[assignment]
                on_lost, name="on_lost", choices=ON_LOST_POLICIES
            )
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
    _deadline: float | None = None
    _held_expire: float = 0.0
    token: str | None = None
    _fence: int | None = None
    acquired_at: float | None = None
    _lost = _reported = False

    #: The stored value of the queued call this lock's first acquire may take
    #: over (see ``calls``); None: take it only if free.
    _take_over: str | None = None

    def __repr__(self) -> str:
        state = "lost" if self.lost else "held" if self._hold is not None else "free"
        return f"<Lock {self.lock_id!r} {state}>"

    @property
    def fence(self) -> int | None:
        """This acquisition's fencing token: larger than that of every earlier
        acquisition of this lock id whose token was read, smaller than every
        later one's. Pass it with writes (see README, Fencing tokens).

        Drawn from the lock's counter on first read, while the store confirms the
        lock is still this holder's (one round trip; a lock whose fence is never
        read leaves no counter behind). None if this object never held the lock;
        raises ``LockLost`` if the lock was lost before a token was drawn (a
        write must not go out unfenced then), and ``LockBackendError`` if the
        store cannot be reached.
        """
        if self._fence is not None:
            return self._fence
        with self._guard:
            if self._fence is not None:
                return self._fence
            if self._hold is None:
                if self._reported:
                    raise LockLost(self.lock_id, self._held_for())
                return None
            backend, key = self._backend()
            assert self.token is not None
            counter = fence_counter(
                backend.keys_for(self.lock_id)[1], self._held_expire
            )
            try:
                drawn = backend.draw_fence(key, self._hold, self.token, counter)
            except backend.errors as exc:
                raise self._store_error(
                    backend, key, "draw the fencing token", exc
                ) from exc
            if drawn is None:
                self._report_lost("fence")
                raise LockLost(self.lock_id, self._held_for())
            self._fence = drawn
            return drawn

    @property
    def lost(self) -> bool:
        """True once the lock is known lost: the heartbeat, a release or an extend
        found it gone or someone else's, or the least time the store keeps it ran
        out with no extension since (the store unreachable, or no renewal)."""
        if not self._reported and self._lapsed():
            self._report_lost("check", self._unextended(), clear=False)
        return self._lost

    def _unextended(self, cause: str = "no extension reached the store") -> str:
        """Why a lock whose sure life ran out is lost, and what to do."""
        if self._life < 1:
            return (
                f"{cause} in time: the store may drop a lock stored for "
                f"{self._held_expire}s at any moment (memcached counts whole "
                "seconds, so it keeps it for less than a second for sure). Use "
                "an expire of 2 seconds or more, with renew=True for long work"
            )
        return (
            f"{cause} within the {self._life:.0f}s the store is sure to keep the "
            "lock. Use a longer expire, or renew=True for long work"
        )

    def _lapsed(self) -> bool:
        valid_until = self._valid_until
        return (
            valid_until is not None
            and self._hold is not None
            and time.monotonic() >= valid_until
        )

    def _forked(self) -> bool:
        """True in a process forked while this object held the lock."""
        return self._held_fork != fork_generation[0]

    # -- settings read on every use -----------------------------------------------

    @property
    def expire(self) -> float:
        """The expiry in seconds: as passed in, else ``TASKLOCK['LOCK_EXPIRE']``."""
        return self._expire if self._expire is not None else settings.LOCK_EXPIRE

    @property
    def renewing(self) -> bool:
        """True while a heartbeat keeps this lock alive."""
        heartbeat = self._heartbeat
        return heartbeat is not None and heartbeat.running

    def _backend(self) -> tuple[LockBackend, str]:
        """This thread's backend and the store key, for the alias of the hold."""
        if (
            self._holder_thread == threading.get_ident()
            and self._held_backend
            and self._held_fork == fork_generation[0]
        ):
            return self._held_backend, self._key  # type: ignore[return-value]
        alias = self._alias or self._cache or settings.CACHE
        backend = backend_for(alias, protocol=settings.MEMCACHED_PROTOCOL)
        key = self._key if self._alias is not None else backend.key_for(self.lock_id)
        assert key is not None
        return backend, key

    def _store_error(
        self, backend: LockBackend, key: str, doing: str, exc: BaseException
    ) -> LockBackendError:
        return LockBackendError(
            f"Could not {doing}: {type(exc).__name__}: {exc}",
            lock_id=self.lock_id,
            store=backend.describe(key),
        )

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
        if self._hold is not None:
            raise LockUsageError(
                f"Lock {self.lock_id!r} is already held by this object; release() it "
                "first, or make a new Lock for a second holder."
            )
        if timeout is not None and not blocking:
            raise LockUsageError("timeout= needs blocking=True.")
        default_expire, default_alias, protocol, default_renew = (
            settings.lock_defaults()
        )
        expire = self._expire if self._expire is not None else default_expire
        if self.max_hold is not None:
            expire = min(expire, self.max_hold)
        renew = self._renew_option if self._renew_option is not None else default_renew
        alias = self._cache or default_alias
        backend = backend_for(alias, protocol=protocol)
        key = backend.keys_for(self.lock_id)[0]
        beat = backend.shortest_life(expire) / 3 if renew else 0.0
        if renew and beat < MIN_BEAT:
            raise LockUsageError(
                f"renew=True needs a longer expiry than {expire}s on {backend.kind}: "
                f"a lock stored for {expire}s may go after "
                f"{backend.shortest_life(expire)}s there (memcached counts whole "
                "seconds), too soon to renew in time. Use an expire (and max_hold) "
                "of 2 seconds or more."
            )
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        pause = POLL_MIN
        tried_at = started
        while True:
            token = new_token(self.owner)
            try:
                if self._take_over is None:
                    hold = backend.acquire(key, token, expire)
                else:
                    hold = self._take_over_call(backend, key, token, expire)
            except backend.errors as exc:
                if not backend.lost_with_store(exc):
                    # Sent, perhaps carried out, reply unknown: the token may be
                    # stored with no holder. Removed once the store answers.
                    pending.watch(self.lock_id, alias, protocol, key, token)
                raise self._store_error(backend, key, "take the lock", exc) from exc
            if hold is not None:
                now = time.monotonic()
                self._hold, self._fence = hold, None
                self._alias, self._key, self.token = alias, key, token
                # Release and extend in this thread reuse this backend (the same
                # connection); another thread looks its own up.
                self._held_backend, self._holder_thread = backend, threading.get_ident()
                self._held_fork = fork_generation[0]
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

    def _take_over_call(
        self, backend: LockBackend, key: str, token: str, expire: float
    ) -> Hold | None:
        """Take the lock from the queued call this run is (see ``calls``): only
        while it stores ``_take_over``, in one conditional write; a free lock is
        taken as usual (its queued mark expired, or was never made)."""
        assert self._take_over is not None
        return backend.take_over(key, self._take_over, token, expire)

    def hand_over(self, value: str, expire: float) -> bool:
        """Store ``value`` in place of this holder's token, in one conditional
        write, and stop holding: how a running call's lock becomes its retry's.

        True if the store had this holder's lock and now has ``value``. Raises
        ``LockBackendError`` if the store cannot be reached (the lock is then
        kept, and released as usual).
        """
        self._require_hold("hand_over()")
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
                self._report_lost("hand over")
                return False
        return True

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

    def _require_hold(self, doing: str) -> None:
        if self._hold is None and not self._reported:
            raise LockUsageError(
                f"{doing} called on Lock {self.lock_id!r}, which this object does not "
                "hold; call acquire() first."
            )
        if self._forked():
            raise LockUsageError(
                f"{doing} called on Lock {self.lock_id!r} in process {os.getpid()}, "
                f"a fork of process {self._pid_of_holder()} that holds it. A forked "
                "child is not the lock's owner and may not release or extend it; do "
                "that in the parent (the child may read owned(), ttl() and fence)."
            )

    def _pid_of_holder(self) -> str:
        owner = token_owner(self.token)
        return "(unknown)" if owner is None else str(owner[1])

    def _held_for(self) -> float:
        return time.monotonic() - (self.acquired_at or time.monotonic())

    def _report_lost(
        self,
        doing: str,
        reason: str = "it expired, was evicted, flushed, released by force or lost "
        "in a restart",
        *,
        clear: bool = True,
    ) -> None:
        """Mark the lock lost and tell (WARNING, ``lock_lost``) once per hold.

        ``clear``: forget the hold (the store no longer has it). A loss judged by
        the clock keeps it, so a release still removes the lock if it survived.
        """
        with _REPORT_GUARD:
            if clear:
                self._hold = None
            if self._reported:
                return
            self._reported = True
        held_for = self._held_for()
        logger.warning(
            "Lock %r was no longer held by this owner at %s, %.1fs after it was taken "
            "with an expiry of %ss: %s, and another owner may have taken it. "
            "The protected work may have overlapped; fenced writes (fence %s) are "
            "refused once a newer holder has written.",
            self.lock_id,
            doing,
            held_for,
            self._held_expire,
            reason,
            self._fence,
        )
        # Only now: whoever sees ``lost`` also finds the WARNING logged.
        self._lost = True
        if lock_lost.receivers:
            self._send(
                lock_lost,
                self.token,
                fence=self._fence,
                held=held_for,
                during=doing,
                reason=reason,
            )

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
            self._require_hold("release()")
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
                    backend, key, self._release_failed(backend, key, token, exc), exc
                ) from exc
            if not released:
                self._report_lost("release")
                return False
            self._hold = None
        if lock_released.receivers:
            self._send(lock_released, token, fence=self._fence, held=self._held_for())
        return True

    def _release_failed(
        self, backend: LockBackend, key: str, token: str, exc: BaseException
    ) -> str:
        """What became of the lock after a release failed with ``exc``."""
        if backend.lost_with_store(exc):
            return (
                "release the lock: the server is not running, and the lock went "
                "with it (a stopped memcached keeps nothing)"
            )
        assert self._alias is not None
        pending.watch(self.lock_id, self._alias, backend.protocol, key, token)
        left = max(0.0, (self._valid_until or 0.0) - time.monotonic()) + 1
        return (
            "release the lock: it is removed in the background as soon as the "
            f"store answers again, and expires by itself within {left:.0f}s at the "
            "latest"
        )

    def extend(self, seconds: float | None = None) -> bool:
        """Reset the lock's expiry to ``seconds`` from now (default: ``expire``),
        never past ``max_hold`` after it was taken.

        Acts only while this object owns the lock: True if extended, False (and a
        WARNING and ``lock_lost``) if the lock was lost.
        """
        self._require_hold("extend()")
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
            self._report_lost(doing)
            return False
        self._hold = hold
        self._life = backend.shortest_life(expire)
        self._valid_until = sent_at + self._life
        return True

    def _renew(self, heartbeat: Heartbeat) -> float | None:
        """One heartbeat: extend the lock; the pause before the next beat, or None
        when renewal should stop."""
        with self._guard:
            if heartbeat.stopped or self._hold is None or self._reported:
                return None
            last = (
                self._deadline is not None
                and self._deadline - time.monotonic() <= self._held_expire
            )
            try:
                renewed = self._extend(None, "renew")
            except LockBackendError as exc:
                if exc.__cause__ is not None and self._backend()[0].lost_with_store(
                    exc.__cause__
                ):
                    self._report_lost(
                        "renew", f"the store stopped and the lock went with it ({exc})"
                    )
                    return None
                # The lock keeps its current expiry: try again, and at the latest
                # when the store may drop it; past that, it is lost.
                left = (self._valid_until or 0.0) - time.monotonic()
                if left <= 0:
                    self._report_lost(
                        "renew",
                        self._unextended(f"the store could not be reached ({exc})"),
                        clear=False,
                    )
                    return None
                logger.warning("Could not renew lock %r: %s", self.lock_id, exc)
                return min(heartbeat.interval, left)
            if renewed and last:
                logger.warning(
                    "Lock %r reaches its max_hold of %ss in %.1fs while its holder "
                    "still runs; renewal stops and the lock expires then.",
                    self.lock_id,
                    self.max_hold,
                    max(0.0, (self._deadline or 0.0) - time.monotonic()),
                )
                return None
            return heartbeat.interval if renewed else None

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
            raise LockLost(self.lock_id, self._held_for())
        return False

    # -- inspection ----------------------------------------------------------------

    def owned(self) -> bool:
        """True if this object holds the lock and the store agrees."""
        if self._hold is None:
            return False
        backend, key = self._backend()
        assert self.token is not None
        try:
            return backend.owned(key, self._hold, self.token)
        except backend.errors as exc:
            raise self._store_error(backend, key, "read the lock", exc) from exc

    def locked(self) -> bool:
        """True if anybody holds the lock."""
        backend, key = self._backend()
        try:
            return backend.locked(key)
        except backend.errors as exc:
            raise self._store_error(backend, key, "read the lock", exc) from exc

    def ttl(self) -> float | None:
        """Seconds left on the current hold, whoever owns it; None if nobody holds it.

        memcached counts whole seconds; ``inf`` means the key never expires (set by
        other code without a timeout).
        """
        backend, key = self._backend()
        try:
            return backend.ttl(key)
        except backend.errors as exc:
            raise self._store_error(
                backend, key, "read the lock's expiry", exc
            ) from exc

    # -- context manager -----------------------------------------------------------

    def release_quietly(self) -> None:
        """Release, logging instead of raising if the store fails.

        For ``finally`` blocks: a failed release must not hide the protected
        code's own result or exception. In a forked child it leaves the lock to
        the parent that holds it.
        """
        if self._hold is not None and self._forked():
            logger.debug(
                "Lock %r is left to the process that holds it (this is a fork)",
                self.lock_id,
            )
            return
        if self._hold is None:
            self._stop_heartbeat()
            return
        try:
            self.release()
        except LockBackendError:
            logger.exception("Could not release lock %r", self.lock_id)


class memcache_lock:
    """The cookbook's ``memcache_lock``, made safe; yields True if the lock was taken.

    ::

        with memcache_lock(lock_id, self.app.oid) as acquired:
            if acquired:
                return Feed.objects.import_feed(feed_url).url
        logger.info("Feed %s is already being imported by another worker", feed_url)

    Unlike the recipe, it releases on exit only a lock this call took and still
    owns (never one that expired and was taken by someone else), and a store that
    cannot be reached raises ``LockBackendError`` instead of looking like
    contention. ``expire``, ``cache`` and ``renew`` default to ``TASKLOCK``; ``oid``
    is kept in the stored value for people reading the store. The Lock is
    ``.lock``: ``cm = memcache_lock(...)``, then ``cm.lock.fence`` in the block.
    """

    def __init__(
        self,
        lock_id: str,
        oid: str | None = None,
        *,
        expire: float | None = None,
        cache: str | None = None,
        renew: bool | None = None,
        max_hold: float | None = None,
    ) -> None:
        #: The Lock underneath, for its ``fence`` and ``lost`` inside the block.
        self.lock = Lock(
            lock_id,
            expire=expire,
            cache=cache,
            oid=oid,
            renew=renew,
            max_hold=max_hold,
        )

    def __enter__(self) -> bool:
        return self.lock.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.lock.release_quietly()
