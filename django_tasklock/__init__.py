"""Owner-checked task locks for Django and Celery, on Django's cache framework."""

from __future__ import annotations

from .decorator import lock_id_for, single_instance
from .exceptions import (
    InvalidLockExpire,
    LockBackendError,
    LockConfigurationError,
    LockNotAcquired,
    LockUsageError,
    TaskLockError,
)
from .locks import Lock, memcache_lock

__version__ = "0.1.0"

__all__ = [
    "InvalidLockExpire",
    "Lock",
    "LockBackendError",
    "LockConfigurationError",
    "LockNotAcquired",
    "LockUsageError",
    "TaskLockError",
    "__version__",
    "lock_id_for",
    "memcache_lock",
    "single_instance",
]
