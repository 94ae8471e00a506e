"""The heartbeat that keeps a renewing lock alive while its holder runs.

One daemon thread per renewing lock, so that a store that hangs on one lock's
extension cannot starve the others. It dies with its process (a crashed or killed
holder stops renewing, and its lock expires within one expiry), stops when the lock
is released, found lost, or reaches its ``max_hold``, and talks to the store over
connections of its own, which it closes when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..backends import close_thread_connections
from ..exceptions import LockBackendError
from .holds import extend_hold
from .loss import report_lost, unextended

if TYPE_CHECKING:
    from .acquisition import Acquisition

__all__ = ["Heartbeat"]

logger = logging.getLogger(__name__)


class Heartbeat:
    """Extends the hold ``acq`` every ``interval`` seconds until stopped."""

    def __init__(self, acq: Acquisition, interval: float) -> None:
        self.acq = acq
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            name=f"tasklock-renew {acq.lock_id[:60]}",
            daemon=True,
        )

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ask the heartbeat to end; it never extends the lock after this returns
        (the lock's guard orders a beat in flight before the release)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            pause: float | None = self.interval
            while pause is not None and not self._stop.wait(pause):
                pause = self.beat()
        finally:
            close_thread_connections()

    def beat(self) -> float | None:
        """Extend the lock once; the pause before the next beat, or None when
        renewal should stop."""
        acq = self.acq
        with acq.guard:
            if self.stopped or acq.hold is None or acq.reported:
                return None
            deadline = acq.deadline
            last = deadline is not None and deadline - time.monotonic() <= acq.expire
            try:
                renewed = extend_hold(acq, None, "renew")
            except LockBackendError as exc:
                return self._failed(exc)
            if renewed and last:
                logger.warning(
                    "Lock %r reaches its max_hold of %ss in %.1fs while its holder "
                    "still runs; renewal stops and the lock expires then.",
                    acq.lock_id,
                    getattr(acq.lock, "max_hold", None),
                    max(0.0, (deadline or 0.0) - time.monotonic()),
                )
                return None
            return self.interval if renewed else None

    def _failed(self, exc: LockBackendError) -> float | None:
        """The store could not be reached: when to try again, if ever."""
        acq = self.acq
        cause = exc.__cause__
        if cause is not None and acq.backend.lost_with_store(cause):
            report_lost(
                acq, "renew", f"the store stopped and the lock went with it ({exc})"
            )
            return None
        # The lock keeps its current expiry: try again, and at the latest when
        # the store may drop it; past that, it is lost.
        left = acq.valid_until - time.monotonic()
        if left <= 0:
            report_lost(
                acq,
                "renew",
                unextended(acq, f"the store could not be reached ({exc})"),
                clear=False,
            )
            return None
        logger.warning("Could not renew lock %r: %s", acq.lock_id, exc)
        return min(self.interval, left)
