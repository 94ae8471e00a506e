"""The exceptions django_tasklock raises; all of them subclass TaskLockError."""

from __future__ import annotations

from django.core.exceptions import ImproperlyConfigured

__all__ = [
    "InvalidLockExpire",
    "LockBackendError",
    "LockConfigurationError",
    "LockNotAcquired",
    "LockUsageError",
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

    def __init__(self, lock_id: str) -> None:
        self.lock_id = lock_id
        super().__init__(
            f"Lock {lock_id!r} is held by another owner; the protected code did not "
            "run. Try again later, or wait for it with Lock.acquire(blocking=True, "
            "timeout=...)."
        )


class LockBackendError(TaskLockError):
    """The store that holds the locks could not be reached or answered an error.

    When this is raised by an acquire, the protected code has not run: nothing
    happened unlocked, and the caller decides whether to retry.
    """

    def __init__(self, message: str, *, lock_id: str, store: str) -> None:
        self.lock_id = lock_id
        self.store = store
        super().__init__(f"{message} (lock {lock_id!r}, store {store})")


class LockConfigurationError(TaskLockError, ImproperlyConfigured):
    """TASKLOCK or the cache it points at cannot give a working lock.

    ``python manage.py check`` reports the same problems as ``django_tasklock.E0xx``
    errors before anything runs.
    """


class InvalidLockExpire(TaskLockError, ValueError):
    """An expiry that is not a positive number of seconds up to 30 days."""


class LockUsageError(TaskLockError, RuntimeError):
    """A Lock object was used out of order, e.g. released without being acquired."""
