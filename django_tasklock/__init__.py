"""Owner-checked task locks for Django and Celery, on Django's cache framework."""

from __future__ import annotations

from .decorator import current_lock, lock_id_for, single_instance
from .exceptions import (
    AlreadyQueued,
    InvalidLockExpire,
    LockBackendError,
    LockConfigurationError,
    LockLost,
    LockNotAcquired,
    LockUsageError,
    TaskLockError,
)
from .locks import Lock, memcache_lock
from .semaphores import Semaphore

__version__ = "0.1.0"

__all__ = [
    "AlreadyQueued",
    "InvalidLockExpire",
    "Lock",
    "LockBackendError",
    "LockConfigurationError",
    "LockLost",
    "LockNotAcquired",
    "LockUsageError",
    "Semaphore",
    "TaskLockError",
    "__version__",
    "current_lock",
    "lock_id_for",
    "memcache_lock",
    "single_instance",
]
