"""The marks a call leaves in the store, from ``.delay()`` to its end.

A call of a task with an enqueue-time mode is published with its lock taken: the
store holds ``queued:<task id>`` under the call's lock id. A worker starting that
task id takes the lock over in one conditional write, storing its run's token,
which names the task id too (``...@host#<task id>:pid:...``). An
``until_started`` call leaves ``started:<task id>`` while it runs. So every
message is matched to one call, and a copy of a message delivered twice finds its
own call already running.

This module reads and writes those marks; it knows nothing of Celery or
``django.tasks`` (``integrations`` does), nor of modes beyond their names.
"""

from __future__ import annotations

import logging

from .backends import LockBackend, backend_for
from .conf import MAX_EXPIRE, settings
from .exceptions import LockBackendError
from .keys import QUEUE_SUFFIX
from .signals import lock_store_failed
from .tokens import token_owner
from .values import QUEUED, STARTED

__all__ = [
    "QUEUE_SUFFIX",
    "Marks",
    "call_of",
    "queue_life",
    "queued",
    "started",
    "store",
    "store_error",
]

logger = logging.getLogger(__name__)


def queued(task_id: str) -> str:
    """The value stored for a call that is published and not yet started."""
    return QUEUED + task_id


def started(task_id: str) -> str:
    """The value an ``until_started`` call leaves when a worker starts it."""
    return STARTED + task_id


def call_of(value: object) -> tuple[str, str] | None:
    """``(state, task id)`` of the call a stored value names: ``"queued"``,
    ``"started"`` or ``"running"``; None for any other value (a lock taken
    outside a worker, or by other code)."""
    if not isinstance(value, str):
        return None
    if value.startswith(QUEUED):
        return "queued", value[len(QUEUED) :]
    if value.startswith(STARTED):
        return "started", value[len(STARTED) :]
    owner = token_owner(value)
    if owner is None:
        return None
    _name, sep, task_id = owner[0].partition("#")
    return ("running", task_id) if sep and task_id else None


def queue_life(queue_expire: float | None, delay: float = 0.0) -> float:
    """Seconds a pending call's lock lasts: its countdown or ETA, plus
    ``queue_expire`` (default ``TASKLOCK['QUEUE_EXPIRE']``)."""
    allowance = queue_expire if queue_expire is not None else settings.QUEUE_EXPIRE
    return min(max(delay, 0.0) + allowance, MAX_EXPIRE)


def store(cache: str | None) -> tuple[LockBackend, str]:
    """This thread's backend for ``cache`` (None: ``TASKLOCK['CACHE']``), and the
    alias."""
    alias = cache or settings.CACHE
    return backend_for(alias), alias


def store_error(
    backend: LockBackend, lock_id: str, doing: str, exc: BaseException
) -> LockBackendError:
    error = LockBackendError(
        f"Could not {doing}: {type(exc).__name__}: {exc}",
        lock_id=lock_id,
        store=backend.describe(backend.keys_for(lock_id)[0]),
    )
    if lock_store_failed.receivers:
        lock_store_failed.send_robust(
            None, lock=None, lock_id=lock_id, doing=doing, error=error
        )
    return error


class Marks:
    """The call marks stored under one lock id, in the store of ``cache``."""

    def __init__(self, cache: str | None, lock_id: str) -> None:
        self.lock_id = lock_id
        self.backend, self.alias = store(cache)
        self.key = self.backend.keys_for(lock_id)[0]

    def start(self, call_id: str, expire: float) -> str:
        """Mark call ``call_id`` started in place of its queued mark (or on a
        free lock id); the mark, to ``clear()`` when the call ends. Raises
        ``LockBackendError`` if the store cannot be reached."""
        backend, key, mark = self.backend, self.key, started(call_id)
        try:
            peek = backend.peek(key)
            if peek is not None and peek.value == queued(call_id):
                backend.replace(key, peek.hold, peek.value, mark, expire)
            elif peek is None:
                backend.acquire(key, mark, expire)
        except backend.errors as exc:
            raise store_error(
                backend, self.lock_id, "mark the call started", exc
            ) from exc
        return mark

    def clear(self, mark: str, failed: str) -> None:
        """Remove ``mark`` if the store still holds it; log ``failed`` (with
        the lock id) if the store cannot be reached."""
        try:
            self.backend.discard(self.key, mark)
        except self.backend.errors:
            logger.exception(failed, self.lock_id)
