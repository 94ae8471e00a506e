"""The heartbeat that keeps a renewing lock alive while its holder runs.

One daemon thread per renewing lock, so that a store that hangs on one lock's
extension cannot starve the others. It dies with its process (a crashed or killed
holder stops renewing, and its lock expires within one expiry), stops when the lock
is released, found lost, or reaches its ``max_hold``, and talks to the store over
connections of its own, which it closes when it ends.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .backends import close_thread_connections

if TYPE_CHECKING:
    from .locks import Lock

__all__ = ["Heartbeat"]


class Heartbeat:
    """Extends ``lock`` every ``interval`` seconds until stopped."""

    def __init__(self, lock: Lock, interval: float) -> None:
        self.lock = lock
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"tasklock-renew {lock.lock_id[:60]}", daemon=True
        )

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._thread.start()

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
                pause = self.lock._renew(self)
        finally:
            close_thread_connections()
