"""Turning a caller's lock id into the key the store sees.

The key is exactly what ``cache.add(lock_id, ...)`` would use (Django's
``make_key``: KEY_PREFIX, VERSION, KEY_FUNCTION), so the cookbook recipe and this
app contend for one lock. Only ids that memcached cannot take as they are (too
long, whitespace or control characters) are hashed; the recipe could not have
used those ids at all (Django raises ``InvalidCacheKey`` for them).
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Final

from .exceptions import InvalidArgument, InvalidArgumentType, LockConfigurationError

if TYPE_CHECKING:
    from django.core.cache.backends.base import BaseCache

__all__ = [
    "FENCE_PREFIX",
    "MEMCACHED_MAX_KEY_BYTES",
    "QUEUE_SUFFIX",
    "RECORD_PREFIX",
    "ROSTER_GROUP",
    "ROSTER_PREFIX",
    "ROSTER_SLOTS",
    "RUN_MARK",
    "SLOT_MARK",
    "check_lock_id",
    "encodable_key",
    "fence_id",
    "hashed_id",
    "lock_group",
    "memcached_key",
    "portable_id",
    "record_id",
]

MEMCACHED_MAX_KEY_BYTES: Final = 250
HASHED_PREFIX: Final = "tasklock-sha256-"
#: The fencing counter of lock ``x`` is stored under the id ``FENCE_PREFIX + x``.
FENCE_PREFIX: Final = "tasklock-fence:"
# memcached's text protocol splits a command line on spaces and ends it at CR LF;
# these bytes must never reach it inside a key (protocol.txt, "Keys").
_UNSAFE_KEY_CHARS: Final = re.compile(r"[\x00-\x20\x7f]")


def check_lock_id(lock_id: object) -> str:
    """Return ``lock_id`` if it is a non-empty str, else raise TypeError/ValueError."""
    if not isinstance(lock_id, str):
        raise InvalidArgumentType(
            f"lock_id must be a str, not {type(lock_id).__name__}; build it from the "
            "task name and a digest of its arguments, e.g. "
            "f'{self.name}-lock-{digest}'."
        )
    if not lock_id:
        raise InvalidArgument("lock_id must be a non-empty str.")
    if lock_id.startswith(FENCE_PREFIX):
        raise InvalidArgument(
            f"lock_id must not start with {FENCE_PREFIX!r}: ids starting so name the "
            f"fencing counters of other locks. Got {lock_id!r}."
        )
    return lock_id


#: How the ids a lock derives from its own end: a semaphore's slots
#: (``<name>#slot-<n>``), an until_started call's run lock (``<id>-run-<task
#: id>``), a coalesced call's queued mark (``<id>-queued``). ``lock_group``
#: reads them back.
SLOT_MARK: Final = "#slot-"
RUN_MARK: Final = "-run-"
QUEUE_SUFFIX: Final = "-queued"


def lock_group(lock_id: str) -> str:
    """The id every key of one lock derives from: ``lock_id`` without the
    fencing counter's prefix, and without a slot, run or queued ending. A
    cluster store puts the keys of one group in one hash slot. (An id of the
    caller's own that happens to contain such an ending only shares its slot
    with another id; its lock and fencing counter are still one group.)"""
    if lock_id.startswith(ROSTER_PREFIX):
        # The lock console's roster (``locks.roster``): a slot's items in
        # one group, and 64 slots to a group, so listing a cluster reads 16
        # hash slots, not 1,024.
        slot = lock_id.removeprefix(ROSTER_PREFIX).partition(":")[0]
        return f"{ROSTER_PREFIX}{int(slot) // ROSTER_GROUP if slot.isdigit() else slot}"
    group = lock_id.removeprefix(FENCE_PREFIX).removesuffix(QUEUE_SUFFIX)
    for mark in (SLOT_MARK, RUN_MARK):
        head, found, _tail = group.rpartition(mark)
        if found and head:
            group = head
    return group


#: The lock console's roster slot ``n`` is stored under ``ROSTER_PREFIX + n``
#: (its further items ``...n:i``); ``ROSTER_GROUP`` slots share a hash slot on
#: a cluster.
ROSTER_PREFIX: Final = "tasklock-roster:"
ROSTER_GROUP: Final = 64
#: How many processes one store's roster lists.
ROSTER_SLOTS: Final = 1024

#: A process's liveness record (``locks.liveness``) is stored under the id
#: ``RECORD_PREFIX + host:process``.
RECORD_PREFIX: Final = "tasklock-alive:"


def record_id(host: str, process: str) -> str:
    """The cache key (before Django's prefix) of a process's liveness record;
    ``process`` as tokens write it, without the ``-s`` flag."""
    return f"{RECORD_PREFIX}{host}:{process}"


def fence_id(lock_id: str) -> str:
    """The id of the fencing counter of ``lock_id``."""
    return FENCE_PREFIX + lock_id


def _fits_memcached(key: str, max_bytes: int) -> bool:
    if _UNSAFE_KEY_CHARS.search(key):
        return False
    try:
        return len(key.encode("utf-8")) <= max_bytes
    except UnicodeEncodeError:  # lone surrogates
        return False


def hashed_id(lock_id: str) -> str:
    """A fixed-length stand-in for ``lock_id``, made of safe characters only."""
    digest = hashlib.sha256(lock_id.encode("utf-8", "surrogatepass")).hexdigest()
    return HASHED_PREFIX + digest


def encodable_key(cache: BaseCache, lock_id: str) -> str:
    """Django's key for ``lock_id``; hashed only if it is not valid UTF-8 text.

    For stores with no key limits but UTF-8 (Redis): only ids with lone
    surrogates, which ``cache.add()`` could not send either, are hashed.
    """
    key = cache.make_key(lock_id)
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        return cache.make_key(hashed_id(lock_id))
    return key


def portable_id(cache: BaseCache, lock_id: str, *, reserved: int = 0) -> str:
    """``lock_id`` itself, or a hash of it when memcached could not store its key.

    The result is what to hand to ``cache.make_key`` (or to the cache API, which
    calls it). ``reserved`` is the length of a key prefix the memcached client adds
    itself (pymemcache's ``key_prefix`` option).
    """
    return _memcached_id_and_key(cache, lock_id, reserved)[0]


def memcached_key(cache: BaseCache, lock_id: str, *, reserved: int = 0) -> str:
    """The memcached key of ``lock_id``: Django's key, hashed only if unusable."""
    return _memcached_id_and_key(cache, lock_id, reserved)[1]


def _memcached_id_and_key(
    cache: BaseCache, lock_id: str, reserved: int
) -> tuple[str, str]:
    max_bytes = MEMCACHED_MAX_KEY_BYTES - reserved
    key = cache.make_key(lock_id)
    if _fits_memcached(key, max_bytes):
        return lock_id, key
    hashed = hashed_id(lock_id)
    key = cache.make_key(hashed)
    if _fits_memcached(key, max_bytes):
        return hashed, key
    raise LockConfigurationError(
        f"The cache's KEY_PREFIX/KEY_FUNCTION turn even a hashed lock id into "
        f"{key!r}, which memcached cannot store (over {max_bytes} bytes, or "
        "whitespace/control characters). Shorten KEY_PREFIX or fix KEY_FUNCTION."
    )
