"""``Lock`` and ``memcache_lock``: owner-checked task locks on Django's cache."""

from __future__ import annotations

import itertools
import logging
import os
import random
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING

from .backends import backend_for
from .conf import settings, validate_expire
from .exceptions import LockBackendError, LockNotAcquired, LockUsageError
from .keys import check_lock_id

if TYPE_CHECKING:
    from types import TracebackType

    from .backends import Hold, LockBackend

__all__ = ["Lock", "memcache_lock"]

logger = logging.getLogger(__name__)

_HOSTNAME = socket.gethostname()


class _Tokens:
    """Unique tokens without a system call per acquisition: a random 64-bit prefix
    per process (drawn again in a forked child) and a counter."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = f"{os.getpid()}:{secrets.token_hex(8)}"
        self.counter = itertools.count()

    def new(self, owner: str) -> str:
        # next() on itertools.count is atomic under the GIL: threads never share one.
        return f"{owner}:{self.prefix}:{threading.get_ident()}:{next(self.counter)}"


_tokens = _Tokens()
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
                do_the_work()
            finally:
                lock.release()

    or, raising ``LockNotAcquired`` when someone else holds it::

        with Lock("nightly-report"):
            do_the_work()

    ``expire`` (seconds, 0 < expire <= 30 days) defaults to
    ``TASKLOCK['LOCK_EXPIRE']`` and ``cache`` (a CACHES alias) to
    ``TASKLOCK['CACHE']``, both read when the lock is acquired. ``oid`` is written
    into the stored token for people reading the store (Celery's ``app.oid``, a
    hostname); it plays no part in the owner check. A Lock object belongs to one
    holder: do not share one object between threads.
    """

    def __init__(
        self,
        lock_id: str,
        *,
        expire: float | None = None,
        cache: str | None = None,
        oid: str | None = None,
    ) -> None:
        self.lock_id = check_lock_id(lock_id)
        self._expire = None if expire is None else validate_expire(expire)
        if cache is not None and (not isinstance(cache, str) or not cache):
            raise TypeError(f"cache must be the name of a CACHES entry, not {cache!r}.")
        if oid is not None and not isinstance(oid, str):
            raise TypeError(f"oid must be a str, not {type(oid).__name__}.")
        self._cache = cache
        self._oid = oid
        self._hold: Hold | None = None
        self._alias: str | None = None
        self._key: str | None = None
        self._held_backend: LockBackend | None = None
        self._holder_thread: int | None = None
        self.token: str | None = None
        self.acquired_at: float | None = None
        #: True once a release or extend found the lock gone or someone else's.
        self.lost = False

    def __repr__(self) -> str:
        state = "held" if self._hold is not None else "lost" if self.lost else "free"
        return f"<Lock {self.lock_id!r} {state}>"

    # -- settings read on every use -----------------------------------------------

    @property
    def expire(self) -> float:
        """The expiry in seconds: as passed in, else ``TASKLOCK['LOCK_EXPIRE']``."""
        return self._expire if self._expire is not None else settings.LOCK_EXPIRE

    def _backend(self) -> tuple[LockBackend, str]:
        """This thread's backend and the store key, for the alias of the hold."""
        if self._holder_thread == threading.get_ident() and self._held_backend:
            return self._held_backend, self._key  # type: ignore[return-value]
        alias = self._alias or self._cache or settings.CACHE
        backend = backend_for(alias, protocol=settings.MEMCACHED_PROTOCOL)
        key = self._key if self._alias is not None else backend.key_for(self.lock_id)
        assert key is not None
        return backend, key

    def _new_token(self) -> str:
        return _tokens.new(self._oid or _HOSTNAME)

    def _store_error(
        self, backend: LockBackend, key: str, doing: str, exc: BaseException
    ) -> LockBackendError:
        return LockBackendError(
            f"Could not {doing}: {type(exc).__name__}: {exc}",
            lock_id=self.lock_id,
            store=backend.describe(key),
        )

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
        default_expire, default_alias, protocol = settings.lock_defaults()
        expire = self._expire if self._expire is not None else default_expire
        alias = self._cache or default_alias
        backend = backend_for(alias, protocol=protocol)
        key = backend.key_for(self.lock_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = POLL_MIN
        while True:
            token = self._new_token()
            try:
                hold = backend.acquire(key, token, expire)
            except backend.errors as exc:
                raise self._store_error(backend, key, "take the lock", exc) from exc
            if hold is not None:
                self._hold, self._alias, self._key, self.token = hold, alias, key, token
                # Release and extend in this thread reuse this backend (the same
                # connection); another thread looks its own up.
                self._held_backend, self._holder_thread = backend, threading.get_ident()
                self.acquired_at = time.monotonic()
                self.lost = False
                return True
            if not blocking:
                return False
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            sleep = random.uniform(pause / 2, pause)
            if deadline is not None:
                sleep = min(sleep, deadline - now)
            time.sleep(sleep)
            pause = min(pause * 2, POLL_MAX)

    # -- release and extend --------------------------------------------------------

    def _require_hold(self, doing: str) -> None:
        if self._hold is None and not self.lost:
            raise LockUsageError(
                f"{doing} called on Lock {self.lock_id!r}, which this object does not "
                "hold; call acquire() first."
            )

    def _report_lost(self, doing: str) -> None:
        held_for = time.monotonic() - (self.acquired_at or time.monotonic())
        self._hold, self.lost = None, True
        logger.warning(
            "Lock %r was no longer held by this owner at %s, %.1fs after it was taken "
            "with an expiry of %ss: it expired, was evicted, flushed or lost in a "
            "restart, and may have been taken by another owner. The protected work "
            "may have overlapped.",
            self.lock_id,
            doing,
            held_for,
            self.expire,
        )

    def release(self) -> bool:
        """Remove the lock if this object still owns it; True if it did.

        A lock found gone or owned by someone else is left alone and logged at
        WARNING (the protected work may have overlapped), and False is returned.
        Raises ``LockBackendError`` if the store cannot be reached; the lock then
        stays until it expires.
        """
        self._require_hold("release()")
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
                f"release the lock; it stays until it expires (up to {self.expire}s)",
                exc,
            ) from exc
        if not released:
            self._report_lost("release")
            return False
        self._hold = None
        return True

    def extend(self, seconds: float | None = None) -> bool:
        """Reset the lock's expiry to ``seconds`` from now (default: ``expire``).

        Acts only while this object owns the lock: True if extended, False (and a
        WARNING) if the lock was lost.
        """
        self._require_hold("extend()")
        if self._hold is None:
            return False
        expire = (
            self.expire if seconds is None else validate_expire(seconds, name="seconds")
        )
        backend, key = self._backend()
        assert self.token is not None
        try:
            hold = backend.extend(key, self._hold, self.token, expire)
        except backend.errors as exc:
            raise self._store_error(backend, key, "extend the lock", exc) from exc
        if hold is None:
            self._report_lost("extend")
            return False
        self._hold = hold
        return True

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
    contention. ``expire`` and ``cache`` default to ``TASKLOCK``; ``oid`` is kept
    in the stored value for people reading the store.
    """

    def __init__(
        self,
        lock_id: str,
        oid: str | None = None,
        *,
        expire: float | None = None,
        cache: str | None = None,
    ) -> None:
        self.lock = Lock(lock_id, expire=expire, cache=cache, oid=oid)

    def __enter__(self) -> bool:
        return self.lock.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.lock.release_quietly()
