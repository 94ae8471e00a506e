"""What a run does when another holds its lock: ``on_contention``.

``skip`` returns None (logged at INFO), ``raise`` raises ``LockNotAcquired``,
``retry`` retries the bound task after ``countdown``, ``wait`` waits up to
``timeout`` and then does ``on_timeout`` (skip or raise), ``park`` parks the
call in its lock's line (``parking``) until a run of the lock ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from ..conf import settings
from ..exceptions import LockNotAcquired
from ..logs import module_logger

if TYPE_CHECKING:
    from ..locks import Lock
    from ..runs import Run
    from ..semaphores import Semaphore

__all__ = ["CONTENTION", "ContentionPolicy", "retry_countdown"]

# Logged under 'django_tasklock.decorator' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.decorator")


class ContentionPolicy:
    """Skip: the run ends with None, unless it is part of a canvas."""

    #: True if acquire() waits for the lock.
    waits = False
    #: True if only a bound task can be served (a run of anything else is
    #: refused before its lock is tried).
    bound_only = False
    #: True if a run's start and end pass through its host's park line.
    parks = False

    def __init__(self) -> None:
        # Read on every run: instance attributes are the interpreter's fastest.
        self.waits, self.bound_only, self.parks = (
            self.waits,
            self.bound_only,
            self.parks,
        )

    def acquire(self, lock: Lock | Semaphore, run: Run) -> bool:
        return lock.acquire()

    async def aacquire(self, lock: Lock | Semaphore, run: Run) -> bool:
        """``acquire``, awaited (the run of an ``async def`` function)."""
        return await lock.aacquire()

    def contended(self, run: Run, lock: Lock | Semaphore) -> Any:
        if run.host.in_canvas(run):
            # A chain's next link, a group's result or a chord's callback would
            # get None as if this run had succeeded: fail it visibly instead.
            logger.info(
                "%s is part of a chain, group or chord and lock %r is held by "
                "another run: failing it with LockNotAcquired instead of skipping it",
                run.name,
                lock.lock_id,
            )
            raise LockNotAcquired(lock.lock_id)
        logger.info(
            "Skipped %s: lock %r is held by another run", run.name, lock.lock_id
        )
        return None


class Raise(ContentionPolicy):
    def contended(self, run: Run, lock: Lock | Semaphore) -> Any:
        raise LockNotAcquired(lock.lock_id)


def retry_countdown(run: Run) -> float:
    """Seconds before a call sent again runs: ``countdown=``, else
    ``TASKLOCK["RETRY_COUNTDOWN"]``."""
    countdown = run.options.countdown
    return settings.RETRY_COUNTDOWN if countdown is None else countdown


class Retry(ContentionPolicy):
    bound_only = True

    def contended(self, run: Run, lock: Lock | Semaphore) -> Any:
        countdown = retry_countdown(run)
        logger.info(
            "Retrying %s in %ss: lock %r is held by another run",
            run.name,
            countdown,
            lock.lock_id,
        )
        return run.host.retry(run, countdown)


def _timeout(run: Run) -> float:
    """How long ``wait`` waits: ``timeout=``, else ``TASKLOCK["WAIT_TIMEOUT"]``."""
    timeout = run.options.timeout
    return settings.WAIT_TIMEOUT if timeout is None else timeout


class Wait(ContentionPolicy):
    waits = True

    def acquire(self, lock: Lock | Semaphore, run: Run) -> bool:
        return lock.acquire(blocking=True, timeout=_timeout(run))

    async def aacquire(self, lock: Lock | Semaphore, run: Run) -> bool:
        return await lock.aacquire(blocking=True, timeout=_timeout(run))

    def contended(self, run: Run, lock: Lock | Semaphore) -> Any:
        return CONTENTION[run.options.on_timeout].contended(run, lock)


class Park(ContentionPolicy):
    """Park the call beside its lock, in line, until a slot frees (the
    host does it: ``integrations.celery.park``)."""

    parks = True

    def contended(self, run: Run, lock: Lock | Semaphore) -> Any:
        return run.host.park(run, lock)


#: The policies by name: ``on_contention`` and ``TASKLOCK["ON_CONTENTION"]``.
CONTENTION: Final[dict[str, ContentionPolicy]] = {
    "skip": ContentionPolicy(),
    "raise": Raise(),
    "retry": Retry(),
    "wait": Wait(),
    "park": Park(),
}
