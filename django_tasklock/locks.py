"""``Lock`` and ``memcache_lock``: owner-checked task locks on Django's cache."""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from typing import TYPE_CHECKING, Final, Literal

from .backends import backend_for
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
from .tokens import fence_counter, new_token

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


#: Shortest and longest pause between two tries of a blocking acquire.
POLL_MIN = 0.01
POLL_MAX = 0.5


class Lock:
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

    Every acquisition draws ``fence``, an integer larger than that of every
    earlier acquisition of the same lock id: pass it with writes so the protected
    resource can refuse a holder that lost the lock (see README, Fencing).

    A Lock object belongs to one holder: do not share it between threads (its own
    heartbeat aside).
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
        self._expire = None if expire is None else validate_expire(expire)
        if cache is not None and (not isinstance(cache, str) or not cache):
            raise TypeError(f"cache must be the name of a CACHES entry, not {cache!r}.")
        if oid is not None and not isinstance(oid, str):
            raise TypeError(f"oid must be a str, not {type(oid).__name__}.")
        self._renew_option = (
            None if renew is None else validate_bool(renew, name="renew")
        )
        self.max_hold = (
            None if max_hold is None else validate_seconds(max_hold, name="max_hold")
        )
        self.on_lost: OnLost = validate_choice(  # type: ignore[assignment]
            on_lost, name="on_lost", choices=ON_LOST_POLICIES
        )
        self._cache = cache
        #: Who this holder is, as written at the start of its tokens.
        self.owner = f"{oid}@{_HOSTNAME}" if oid else _HOSTNAME
        self._hold: Hold | None = None
        self._alias: str | None = None
        self._key: str | None = None
        self._held_backend: LockBackend | None = None
        self._holder_thread: int | None = None
        # Serialises the heartbeat's extend with the holder's release and extend;
        # reentrant, so a lock_lost receiver may call release() on this lock.
        self._guard = threading.RLock()
        self._heartbeat: Heartbeat | None = None
        self._deadline: float | None = None
        self._held_expire: float = 0.0
        self.token: str | None = None
        self.fence: int | None = None
        self.acquired_at: float | None = None
        #: True once the heartbeat, a release or an extend found the lock gone or
        #: someone else's.
        self.lost = False

    def __repr__(self) -> str:
        state = "held" if self._hold is not None else "lost" if self.lost else "free"
        return f"<Lock {self.lock_id!r} {state}>"

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
        if self._holder_thread == threading.get_ident() and self._held_backend:
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
        key, counter_key = backend.keys_for(self.lock_id)
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
        while True:
            token = new_token(self.owner)
            counter = fence_counter(counter_key, expire)
            try:
                taken = backend.acquire(key, token, expire, counter)
            except backend.errors as exc:
                raise self._store_error(backend, key, "take the lock", exc) from exc
            if taken is not None:
                now = time.monotonic()
                self._hold, self.fence = taken
                self._alias, self._key, self.token = alias, key, token
                # Release and extend in this thread reuse this backend (the same
                # connection); another thread looks its own up.
                self._held_backend, self._holder_thread = backend, threading.get_ident()
                self.acquired_at, self.lost, self._held_expire = now, False, expire
                self._deadline = None if self.max_hold is None else now + self.max_hold
                if renew:
                    self._heartbeat = Heartbeat(self, beat)
                    self._heartbeat.start()
                if lock_acquired.receivers:
                    self._send(
                        lock_acquired, token, fence=self.fence, waited=now - started
                    )
                return True
            now = time.monotonic()
            if not blocking or (deadline is not None and now >= deadline):
                if lock_contended.receivers:
                    self._send_contended(backend, key, now - started)
                return False
            sleep = random.uniform(pause / 2, pause)
            if deadline is not None:
                sleep = min(sleep, deadline - now)
            time.sleep(sleep)
            pause = min(pause * 2, POLL_MAX)

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
        if self._hold is None and not self.lost:
            raise LockUsageError(
                f"{doing} called on Lock {self.lock_id!r}, which this object does not "
                "hold; call acquire() first."
            )

    def _held_for(self) -> float:
        return time.monotonic() - (self.acquired_at or time.monotonic())

    def _report_lost(self, doing: str) -> None:
        held_for = self._held_for()
        self._hold, self.lost = None, True
        logger.warning(
            "Lock %r was no longer held by this owner at %s, %.1fs after it was taken "
            "with an expiry of %ss: it expired, was evicted, flushed, released by "
            "force or lost in a restart, and may have been taken by another owner. "
            "The protected work may have overlapped; fenced writes (fence %s) are "
            "refused once a newer holder has written.",
            self.lock_id,
            doing,
            held_for,
            self._held_expire,
            self.fence,
        )
        if lock_lost.receivers:
            self._send(
                lock_lost, self.token, fence=self.fence, held=held_for, during=doing
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
        self._require_hold("release()")
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
                    backend,
                    key,
                    "release the lock; it stays until it expires "
                    f"(up to {self._held_expire}s)",
                    exc,
                ) from exc
            if not released:
                self._report_lost("release")
                return False
            self._hold = None
        if lock_released.receivers:
            self._send(lock_released, token, fence=self.fence, held=self._held_for())
        return True

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
        try:
            hold = backend.extend(key, self._hold, self.token, expire)
        except backend.errors as exc:
            raise self._store_error(backend, key, "extend the lock", exc) from exc
        if hold is None:
            self._report_lost(doing)
            return False
        self._hold = hold
        return True

    def _renew(self, heartbeat: Heartbeat) -> bool:
        """One heartbeat: extend the lock; False when renewal should stop."""
        with self._guard:
            if heartbeat.stopped or self._hold is None:
                return False
            last = (
                self._deadline is not None
                and self._deadline - time.monotonic() <= self._held_expire
            )
            try:
                renewed = self._extend(None, "renew")
            except LockBackendError as exc:
                # The lock keeps its current expiry; the next beat tries again,
                # and reports it lost if it expired meanwhile.
                logger.warning("Could not renew lock %r: %s", self.lock_id, exc)
                return True
            if renewed and last:
                logger.warning(
                    "Lock %r reaches its max_hold of %ss in %.1fs while its holder "
                    "still runs; renewal stops and the lock expires then.",
                    self.lock_id,
                    self.max_hold,
                    max(0.0, (self._deadline or 0.0) - time.monotonic()),
                )
                return False
            return renewed

    def check(self) -> bool:
        """True while the lock is not known to be lost. Costs no round trip.

        With ``on_lost="raise"``, a lost lock raises ``LockLost`` instead of
        returning False. Call it between steps of long work, with ``renew=True``
        (the heartbeat is what finds a lost lock while the body runs).
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
        code's own result or exception.
        """
        if self._hold is None:
            self._stop_heartbeat()
            return
        try:
            self.release()
        except LockBackendError:
            logger.exception("Could not release lock %r", self.lock_id)

    def __enter__(self) -> Lock:
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
