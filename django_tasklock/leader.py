"""One leader among processes: ``Leadership``.

A process that must run alone (a scheduler, a consumer, a cron loop) takes a
renewed ``Lock`` named after its role; every other process that wants the role
stands by and tries to take it once a ``poll``. The leader is the lock's
holder, so everything the lock guarantees holds for leadership:

- **Never two leaders by their own clocks.** ``is_leader`` is the lock's
  ``check()``, which costs no round trip: false once the lock is known lost,
  and once the least time the store is sure to keep it, or the holder's
  liveness record, may have run out (a paused process, a starved heartbeat, a
  store out of reach). A contender takes the lock only after that.
- **A dead leader is replaced within** ``TASKLOCK["LIVENESS"]`` **plus one
  poll**: its liveness record stops being renewed, and a standby's next try
  judges it dead and takes the lock (crash recovery). A paused leader that was
  replaced finds ``is_leader`` false at its first look, and ``on_loss`` runs;
  one that lost the role by its own clock while nobody took it removes its
  token and takes the role anew (a larger fence) at its next try.
- **A fence (epoch) that grows with every new leader**: ``fence``, drawn when
  the leadership is gained. Pass it with whatever the leader writes, so that a
  store which saw a newer leader's fence refuses an older one's (a leader that
  lost the lock between its check and its write).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .backends import refuse_per_process
from .conf import settings, validate_seconds
from .exceptions import InvalidArgument, LockBackendError, LockLost, LockUsageError
from .locks import Lock
from .locks.fencing import holders, push_holder

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextvars import Token

__all__ = ["LOCK_PREFIX", "Leadership"]

logger = logging.getLogger(__name__)

#: The lock id of the leadership of ``name`` is ``LOCK_PREFIX + name``.
LOCK_PREFIX = "leader-"
#: Default seconds between a standby's tries, and a leader's looks at its lock.
POLL = 1.0
#: Default seconds the leadership lock lasts unless renewed (renewed every
#: third): a leader whose process stops renewing loses it by then at most.
EXPIRE = 30.0


class Leadership:
    """Leadership of ``name`` among the processes that ask for it.

    ``start()`` (or ``with``) runs a thread that takes the role when it is
    free and watches it while held; ``stop()`` gives it up::

        leadership = Leadership("beat", on_gain=start_sending, on_loss=stop_sending)
        with leadership:
            while running:
                if leadership.is_leader:
                    send_due_runs(fence=leadership.fence)
                time.sleep(1)

    ``cache`` (a CACHES alias) and ``expire`` as for ``Lock``; ``poll``:
    seconds between a standby's tries. ``on_gain`` and ``on_loss`` are called
    with this object, in its thread, when the role is taken and when it is
    lost (given up, found lost, or out of time); an exception there is logged.
    """

    def __init__(
        self,
        name: str,
        *,
        cache: str | None = None,
        expire: float = EXPIRE,
        poll: float = POLL,
        on_gain: Callable[[Leadership], object] | None = None,
        on_loss: Callable[[Leadership], object] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(
                f"a leadership needs a name (a non-empty str), not {name!r}"
            )
        self.name = name
        self.lock_id = LOCK_PREFIX + name
        self.cache = cache
        self.expire = validate_seconds(expire, name="expire")
        self.poll = validate_seconds(poll, name="poll")
        self.on_gain, self.on_loss = on_gain, on_loss
        #: When this process last became leader (``time.time()``), or None.
        self.since: float | None = None
        self._lock: Lock | None = None
        self._fence: int | None = None
        self._stop = threading.Event()
        self._leading = threading.Event()
        self._thread: threading.Thread | None = None
        #: Whether a try was refused since this process last led (logged once).
        self._standing = False
        self._fence_reset: Token[Any] | None = None

    def __repr__(self) -> str:
        state = f"leader since {self.since:.0f}" if self.is_leader else "standing by"
        return f"<Leadership {self.name!r}: {state}>"

    # -- what a caller asks -----------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this process holds the role: no round trip, never true
        once the lock may have gone (by this process's clock)."""
        lock = self._lock
        return lock is not None and not lock.lost

    @property
    def fence(self) -> int | None:
        """The epoch of this leadership (larger for every later leader), or
        None while not leader."""
        return self._fence if self.is_leader else None

    def held_fence(self) -> int:
        """``fence``, for a write now: raises ``LockLost`` unless this process
        leads (``is_leader``)."""
        fence = self.fence
        if fence is None:
            since = self.since
            raise LockLost(self.lock_id, 0.0 if since is None else time.time() - since)
        return fence

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until this process leads; whether it does."""
        self._leading.wait(timeout)
        return self.is_leader

    # -- the thread ---------------------------------------------------------------

    def start(self) -> Leadership:
        """Start standing by (and leading, once the role is free)."""
        if self._thread is not None:
            raise LockUsageError(f"leadership {self.name!r} was started already")
        refuse_per_process(
            [self.cache or settings.CACHE],
            f"Leadership {self.name!r} would let every process lead at once",
        )
        self._thread = threading.Thread(
            target=self._run, name=f"tasklock-leader-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Give the role up (released, owner-checked, for a standby to take at
        its next try) and stop standing by."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def __enter__(self) -> Leadership:
        """Start; inside the block, fenced writes carry the leader's fence
        (refused while this process does not lead)."""
        self.start()
        self._fence_reset = push_holder(self, self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        reset, self._fence_reset = self._fence_reset, None
        if reset is not None:
            holders.reset(reset)
        self.stop()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._lock is None:
                    self._try()
                elif self._lock.lost:
                    lost = self._lock
                    self._lose("lost")
                    # Gone from the store, or ours still, as when this process
                    # was paused past its liveness record's life and nobody
                    # took the role: removed then (owner-checked), so that
                    # every candidate, this one too, may take it at its next
                    # try, not only once the lock expires.
                    lost.release_quietly()
                self._stop.wait(self.poll)
        finally:
            if self._lock is not None:
                self._lock.release_quietly()
                self._lose("given up")

    def _try(self) -> None:
        lock = Lock(self.lock_id, cache=self.cache, expire=self.expire, renew=True)
        try:
            if not lock.acquire():
                if not self._standing:
                    self._standing = True
                    logger.info("Standing by for %r: another process leads", self.name)
                return
            fence = lock.fence
        except LockBackendError as exc:
            logger.warning("Could not try for leadership %r: %s", self.name, exc)
            lock.release_quietly()
            return
        self._lock, self._fence, self.since = lock, fence, time.time()
        self._standing = False
        self._leading.set()
        logger.info("Leading %r (fence %s)", self.name, fence)
        self._call(self.on_gain)

    def _lose(self, how: str) -> None:
        self._lock = None
        self._leading.clear()
        logger.warning("No longer leading %r: %s", self.name, how)
        self._call(self.on_loss)
        self._fence = self.since = None

    def _call(self, callback: Callable[[Leadership], object] | None) -> None:
        if callback is None:
            return
        try:
            callback(self)
        except Exception:
            logger.exception("A callback of leadership %r failed", self.name)
