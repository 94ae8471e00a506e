"""The primitive: an owner-checked lock on one lock id, and its collaborators.

``lock`` holds acquire, release, extend and the hold; ``options`` checks what a
Lock may be given; ``waiting`` paces a blocking acquire; ``heartbeat`` renews a
held lock; ``loss`` tells that a lock was lost; ``fencing`` draws fencing tokens;
``holding`` is the ``with`` statement; ``recipe`` is the cookbook's
``memcache_lock``. Nothing here knows of Celery, tasks or calls.
"""

from __future__ import annotations

from .holding import Holding
from .lock import Lock
from .recipe import memcache_lock
from .validation import MIN_BEAT, ON_LOST_POLICIES, OnLost, check_oid
from .waiting import POLL_MAX, POLL_MIN, backoff

__all__ = [
    "MIN_BEAT",
    "ON_LOST_POLICIES",
    "POLL_MAX",
    "POLL_MIN",
    "Holding",
    "Lock",
    "OnLost",
    "backoff",
    "check_oid",
    "memcache_lock",
]
