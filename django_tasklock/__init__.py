"""Owner-checked task locks for Django and Celery, on Django's cache framework."""

from __future__ import annotations

from .decorator import single_instance
from .exceptions import (
    AlreadyQueued,
    InvalidArgument,
    InvalidArgumentType,
    InvalidLockExpire,
    LockBackendError,
    LockConfigurationError,
    LockLost,
    LockNotAcquired,
    LockUsageError,
    NoFence,
    ParkedCallDropped,
    ParkFull,
    RateLimited,
    StaleFence,
    TaskLockError,
)
from .leader import Leadership
from .limits.decorator import current_admission, rate_limited
from .limits.limiter import Admission, RateLimiter
from .locks import Lock, memcache_lock
from .runs import current_lock
from .semaphores import Semaphore
from .targets import lock_id_for

__version__ = "0.1.0"

__all__ = [
    "Admission",
    "AlreadyQueued",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidLockExpire",
    "Leadership",
    "Lock",
    "LockBackendError",
    "LockConfigurationError",
    "LockLost",
    "LockNotAcquired",
    "LockUsageError",
    "NoFence",
    "ParkFull",
    "ParkedCallDropped",
    "RateLimited",
    "RateLimiter",
    "Semaphore",
    "StaleFence",
    "TaskLockError",
    "__version__",
    "current_admission",
    "current_lock",
    "lock_id_for",
    "memcache_lock",
    "rate_limited",
    "single_instance",
]
