"""The exceptions django_tasklock raises; all of them subclass TaskLockError.

A wrong argument or setting raises ``InvalidArgument`` (a ``ValueError``) or
``InvalidArgumentType`` (a ``TypeError``), so ``except ValueError`` still
catches what it caught before. Errors of Python itself and of other packages
(a ``KeyboardInterrupt``, a bug's ``AttributeError``, a Celery ``Retry``
raised on purpose) pass through unchanged.
"""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

__all__ = [
    "AlreadyQueued",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidLockExpire",
    "LockBackendError",
    "LockConfigurationError",
    "LockLost",
    "LockNotAcquired",
    "LockUsageError",
    "NoFence",
    "ParkFull",
    "ParkedCallDropped",
    "RateLimited",
    "StaleFence",
    "TaskLockError",
]


class TaskLockError(Exception):
    """Base class of every error raised by django_tasklock."""


class LockNotAcquired(TaskLockError):
    """The lock is held by someone else, so the protected code did not run.

    Raised by ``with Lock(...):`` and by ``@single_instance(on_contention="raise")``.
    Use ``memcache_lock`` (which yields False) or ``Lock.acquire()`` (which returns
    False) where contention is a normal outcome rather than an error.
    """

    def __init__(self, lock_id: str, reason: str = "") -> None:
        self.lock_id = lock_id
        #: Why the call could not wait for the lock, where it could not (a call
        #: run in place, inside a run that holds the lock); else "".
        self.reason = reason
        # args are the constructor's: Celery rebuilds a task's exception from them.
        super().__init__(lock_id, reason) if reason else super().__init__(lock_id)

    def __str__(self) -> str:
        if self.reason:
            return f"Lock {self.lock_id!r} is held; the protected code did not run: {self.reason}"
        return (
            f"Lock {self.lock_id!r} is held by another owner; the protected code did "
            "not run. Try again later, or wait for it with Lock.acquire(blocking=True, "
            "timeout=...)."
        )


class ParkFull(LockNotAcquired):
    """Every slot of the call's lock is taken and its park line is full, so the
    call was refused (``on_contention="park"`` with ``on_park_full="refuse"``):
    the call's own result is this error. Raise ``park=`` or run fewer calls
    of that key."""

    def __init__(self, lock_id: str, parked: int) -> None:
        self.parked = parked
        super().__init__(lock_id, f"its park line is full ({parked} parked)")
        # args are the constructor's: Celery rebuilds a task's exception from them.
        self.args = (lock_id, parked)


class ParkedCallDropped(TaskLockError):
    """A parked call left its line without running: a newer call took its
    place (``on_park_full="drop_oldest"`` or ``"replace"``). The parked
    call's result is this error; ``by`` is the call that took its place."""

    def __init__(self, task_id: str, lock_id: str, by: str) -> None:
        self.task_id, self.lock_id, self.by = task_id, lock_id, by
        # args are the constructor's: pickle and Celery rebuild it from them.
        super().__init__(task_id, lock_id, by)

    def __str__(self) -> str:
        return (
            f"Call {self.task_id!r} was parked under lock {self.lock_id!r} and left "
            f"its full line without running: call {self.by!r} took its place "
            "(on_park_full). Send it again, or raise park= so that more calls wait."
        )


class AlreadyQueued(TaskLockError):
    """An identical call is already pending or running, so this one was not sent.

    Raised by ``.delay()``/``.apply_async()`` of a task decorated with
    ``@single_instance(mode=..., on_duplicate="raise")``. ``task_id`` is the
    call that is pending or running (``app.AsyncResult(exc.task_id)`` waits for
    it); ``lock_id`` the lock both calls share.
    """

    def __init__(self, task_id: str | None, lock_id: str) -> None:
        self.task_id = task_id
        self.lock_id = lock_id
        # args are the constructor's: pickle and Celery rebuild it from them.
        super().__init__(task_id, lock_id)

    def __str__(self) -> str:
        which = (
            "with an unknown task id" if self.task_id is None else repr(self.task_id)
        )
        return (
            f"An identical call ({which}) is already pending or running under lock "
            f"{self.lock_id!r}; this call was not sent. Wait for that one "
            "(app.AsyncResult(exc.task_id).get()), or send again once it is over."
        )


class LockLost(TaskLockError):
    """The lock expired, was evicted, flushed or released by force while its holder
    still ran: another owner may be running the protected code now.

    Raised by ``Lock.check()`` on a lock made with ``on_lost="raise"``. Stop the
    work, or carry on only with writes fenced by ``lock.fence``. ``lock_id`` is
    the lock, ``held_for`` the seconds it had been held when found lost.
    """

    def __init__(self, lock_id: str, held_for: float) -> None:
        self.lock_id = lock_id
        self.held_for = held_for
        # args are the constructor's: pickle and Celery's result backends
        # rebuild it from them.
        super().__init__(lock_id, held_for)

    def __str__(self) -> str:
        return (
            f"Lock {self.lock_id!r} was lost {self.held_for:.1f}s after it was taken: "
            "it expired, was evicted, flushed or released by force, and another "
            "owner may hold it now. Stop the protected work; writes fenced with "
            "lock.fence are refused from here on."
        )


class RateLimited(TaskLockError):
    """A rate limit refused the call, so the protected code did not run.

    Raised by ``@rate_limited(on_limit="raise")``, by ``on_limit="wait"`` once
    its timeout is spent, and by ``on_limit="retry"`` where a call cannot be
    sent again (called directly, or eagerly). ``limit_id`` is the limit,
    ``retry_after`` the seconds until it could admit one.
    """

    def __init__(self, limit_id: str, retry_after: float) -> None:
        self.limit_id = limit_id
        self.retry_after = retry_after
        # args are the constructor's: pickle and Celery's result backends
        # rebuild it from them.
        super().__init__(limit_id, retry_after)

    def __str__(self) -> str:
        return (
            f"Rate limit {self.limit_id!r} admits no more calls now; the protected "
            f"code did not run. The next admission is possible in "
            f"{self.retry_after:.2f}s: try again then."
        )


class LockBackendError(TaskLockError):
    """The store that holds the locks could not be reached or answered an error.

    When this is raised by an acquire, the protected code has not run: nothing
    happened unlocked, and the caller decides whether to retry. ``lock_id`` is
    the lock, ``store`` names the store (kind, alias and server), ``message``
    what failed.
    """

    def __init__(self, message: str, lock_id: str, store: str) -> None:
        self.message = message
        self.lock_id = lock_id
        self.store = store
        # args are the constructor's: pickle and Celery's result backends
        # rebuild it from them.
        super().__init__(message, lock_id, store)

    def __str__(self) -> str:
        return f"{self.message} (lock {self.lock_id!r}, store {self.store})"


class LockConfigurationError(TaskLockError, ImproperlyConfigured):
    """TASKLOCK or the cache it points at cannot give a working lock.

    ``python manage.py check`` reports the same problems as ``django_tasklock.E0xx``
    errors before anything runs.
    """


class InvalidArgument(TaskLockError, ValueError):
    """An argument or setting whose value cannot be used; the message says
    which and what would do."""


class InvalidArgumentType(TaskLockError, TypeError):
    """An argument of the wrong kind (a function where a bound Celery task is
    needed, a decorator in the wrong order); the message says what to pass."""


class InvalidLockExpire(InvalidArgument):
    """An expiry that is not a positive number of seconds up to 30 days."""


class LockUsageError(TaskLockError, RuntimeError):
    """A Lock object was used out of order, e.g. released without being acquired."""


class StaleFence(TaskLockError):
    """A fenced write (``django_tasklock.fenced``) refused by the database: the
    row was written by a newer holder of the lock than this writer.

    This writer's lock was lost (it expired while the process was paused, or
    the store lost it) and another holder took it and wrote since; the write
    would have put older data over newer. Nothing was written. ``row`` names
    the row (model label and lookup), ``field`` its fence field, ``stored`` the
    fence stored there, ``fence`` this writer's.
    """

    def __init__(self, row: str, field: str, stored: int, fence: int) -> None:
        self.row, self.field, self.stored, self.fence = row, field, stored, fence
        super().__init__(row, field, stored, fence)

    def __str__(self) -> str:
        return (
            f"Refused a stale write to {self.row}: its {self.field} is "
            f"{self.stored}, newer than this writer's fence {self.fence}. A newer "
            "holder of the lock wrote it after this writer's lock was lost; "
            "nothing was written. Stop this work: its result is superseded."
        )


class NoFence(LockUsageError):
    """A fenced write found no fence to carry: no lock is held in this context,
    or no holder here is the one its ``FenceField(lock=...)`` names. Nothing was
    written; the message says how to give one."""
