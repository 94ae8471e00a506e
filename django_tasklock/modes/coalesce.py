"""``coalesce``: at most one call pending and one running per lock id.

Published: the call's lock is taken under ``<lock id>-queued`` with its queued
mark, so an identical ``.delay()`` while one is pending is a duplicate, while one
may be queued beside a running call. Run: the worker waits for the running call's
lock (a pending call is never dropped), clears its pending mark once it holds the
lock (a call made from then on is a new one), and if the wait runs out, the call
goes back to the broker with the same task id instead of being lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..calls import QUEUE_SUFFIX, Marks, queued
from ..exceptions import LockNotAcquired
from ..logs import module_logger
from ..policies.contention import retry_countdown
from .base import Mode

if TYPE_CHECKING:
    from ..locks import Lock
    from ..policies import ContentionPolicy
    from ..runs import Run
    from ..semaphores import Semaphore

__all__ = ["Coalesce"]

# Logged under 'django_tasklock.decorator' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.decorator")


class Coalesce(Mode):
    name = "coalesce"
    queue_suffix = QUEUE_SUFFIX
    # A pending call is never dropped: it waits its turn.
    call_policy = "wait"

    def contended(
        self, run: Run, lock: Lock | Semaphore, policy: ContentionPolicy
    ) -> Any:
        if run.call_id is None:
            return super().contended(run, lock, policy)
        countdown = retry_countdown(run)
        logger.info(
            "%s[%s] waited for lock %r in vain; sent again with a countdown of %ss",
            run.name,
            run.call_id,
            lock.lock_id,
            countdown,
        )
        try:
            return run.host.send_back(run, lock, countdown)
        except LockNotAcquired:
            # A call run in place cannot be sent back: it fails, and leaves no
            # mark for later calls to join.
            self.forget_pending(run)
            raise

    takes = True

    def taken(self, run: Run, lock: Lock | Semaphore) -> None:
        if run.call_id is not None:
            # The call runs now; a call made from here on is a new one.
            Marks(run.options.cache, self.on_publish(run.lock_id)).clear(
                queued(run.call_id),
                "Could not clear the pending mark of lock %r; calls made during "
                "this run join it until it expires",
            )
