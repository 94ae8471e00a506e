"""A second delivery of a call's message: tell it from a new call, and judge
whether the run holding the call's lock is still alive.

Brokers deliver a message again after a visibility timeout, or when a worker
died with ``acks_late`` and ``task_reject_on_worker_lost``. The copy meets a lock
whose token names its own task id. It is dropped while the run holding that lock
is alive (judged as ``locks.recovery`` judges: /proc on this host, the liveness
record from another); the lock of a dead run is removed, owner-checked, and the
copy runs; a run that cannot be judged yet (another host, its record still
there) sends the copy back to the broker until it can be. Shared by the Celery
and ``django.tasks`` hosts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..calls import call_of, store
from ..conf import settings
from ..exceptions import LockBackendError
from ..locks import Lock
from ..locks.recovery import judge
from ..logs import module_logger
from ..runs import DEFER, DROP, FREED

if TYPE_CHECKING:
    from ..runs import Run
    from ..semaphores import Semaphore

__all__ = ["MAX_DEFER", "defer_for", "verdict"]

# Logged under 'django_tasklock.decorator' before: that name keeps working (see logs).
logger = module_logger(__name__, "django_tasklock.decorator")

#: The longest a copy whose run's host cannot be asked is put back for.
MAX_DEFER = 3600.0


def verdict(run: Run, lock: Lock | Semaphore) -> object:
    """``DROP``, ``FREED`` or ``DEFER`` if the holder of ``lock`` is this very
    call (its message delivered again); None if it is not."""
    if not isinstance(lock, Lock):
        return None  # a Semaphore's slots do not name the call
    try:
        peek = lock.peek()
    except LockBackendError:
        return None
    holder = None if peek is None else call_of(peek.value)
    if peek is None or holder is None or holder[1] != run.call_id:
        return None
    if holder[0] == "queued":
        return None  # its own queued mark: taken over by the acquire
    backend, _alias = store(run.options.cache)
    try:
        key = backend.keys_for(lock.lock_id)[0]
        alive, _why = judge(peek.value, backend, key)
    except backend.errors:
        alive = None
    if alive is None:
        return DEFER
    if alive:
        logger.warning(
            "Dropped a second delivery of %s[%s]: that call is already running "
            "(lock %r). The broker delivered its message again (a visibility "
            "timeout or acks_late redelivery).",
            run.name,
            run.call_id,
            lock.lock_id,
        )
        return DROP
    try:
        freed = lock.remove(peek)
    except LockBackendError:
        freed = False
    logger.warning(
        "%s[%s] was delivered again after the process running it (%s) died; %s",
        run.name,
        run.call_id,
        peek.value,
        "its lock was removed and this copy runs"
        if freed
        else "its lock changed meanwhile, and this copy takes its chances",
    )
    return FREED


def defer_for(run: Run, lock: Lock) -> float:
    """How long a copy of a call running on another host is put back for: the
    lock's time left (at most ``MAX_DEFER``), and a second; with liveness
    records on, at most ``LIVENESS`` and a second, by when a dead run's record
    is gone."""
    try:
        left = lock.ttl()
    except LockBackendError:
        left = None
    countdown = min(MAX_DEFER, (left if left is not None else 0.0) + 1.0)
    if settings.LIVENESS is not None:
        countdown = min(countdown, settings.LIVENESS + 1.0)
    logger.warning(
        "%s[%s] was delivered again while lock %r names its run on another host, "
        "whose process cannot be judged from here yet; sent again with a "
        "countdown of %.0fs, to run then if the lock is free.",
        run.name,
        run.call_id,
        lock.lock_id,
        countdown,
    )
    return countdown
